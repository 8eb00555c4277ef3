"""How a phased exchange is cut into pipeline chunks: one definition for the schedulers
(:mod:`cocodiff.schedules.tapa`), the simulator and the runtime
(:mod:`cocodiff.runtime.tapa`).

A Ulysses exchange moves *blocks*: block (s, d) is the rows member s sends member d, one
row per head, each row ``batch x local_tokens x head_dim`` values. A chunk must carry
about ``1/chunks`` of every block, or the pipeline silently degenerates (chunk 0 takes
everything, the rest are empty). Two ways, chosen per exchange pattern from the head
counts alone, so every rank agrees:

* **rows**: every block has at least ``chunks`` rows: each block's rows are split as
  evenly as possible (:func:`chunk_rows`, the first chunks one larger); a chunk's rows
  are whole rows, contiguous in memory.
* **tokens**: some block has fewer rows than chunks (one head per rank: every block is
  one row): every row is cut along its tokens instead; chunk c carries tokens
  ``[sum(tokens[:c]), sum(tokens[:c + 1]))`` of *every* row (:func:`chunk_tokens`).

A chunk count is refused (:func:`check_chunk_count`) only when some chunk would be
empty everywhere: more chunks than a row has tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from cocodiff.util.errors import ScheduleError


def chunk_rows(rows: int, chunk: int, chunks: int) -> int:
    """Rows (or tokens) of chunk ``chunk`` of ``rows`` split in ``chunks`` as evenly as
    possible, the first chunks one larger."""
    base, extra = divmod(rows, chunks)
    return base + (1 if chunk < extra else 0)


def block_rows(rows: int, chunk: int, chunks: int, by_tokens: bool) -> int:
    """Rows of a block of ``rows`` rows that chunk ``chunk`` carries: a share of them, or,
    when the chunks cut tokens (``by_tokens``), all of them, each in part."""
    return rows if by_tokens else chunk_rows(rows, chunk, chunks)


def cuts_tokens(heads: Sequence[int], chunks: int) -> bool:
    """Whether ``chunks`` chunks cut an exchange among members holding ``heads`` heads
    along tokens: some non-empty block has fewer rows than chunks. A block's rows are one
    member's head count (the other factor is 1), so the smallest non-empty block has the
    fewest heads of any member that has some."""
    return chunks > 1 and any(0 < h < chunks for h in heads)


def chunk_tokens(row_tokens: int, chunks: int) -> tuple[int, ...]:
    """Tokens of every row that each chunk carries, when chunks cut tokens."""
    return tuple(chunk_rows(row_tokens, c, chunks) for c in range(chunks))


def check_chunk_count(chunks: int, heads: Sequence[int], row_tokens: int) -> None:
    """Refuse a chunk count that leaves some chunk empty on every rank.

    Raises:
        ScheduleError: chunks cut tokens (:func:`cuts_tokens`) and a row has fewer
            tokens than chunks.
    """
    if cuts_tokens(heads, chunks) and chunks > row_tokens:
        raise ScheduleError(
            f"{chunks} chunks: blocks of {min(h for h in heads if h)} row(s) are cut along "
            f"their rows' {row_tokens} token(s), so chunks past {row_tokens} would be empty "
            f"on every rank; use at most {row_tokens}")


__all__ = ["block_rows", "check_chunk_count", "chunk_rows", "chunk_tokens", "cuts_tokens"]

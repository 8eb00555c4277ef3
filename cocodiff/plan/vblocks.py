"""V-Major's blocks on the wire: how a V row is cut into blocks, and what a partial
message weighs. Plan data: the schedulers record it in the phases they plan, the
simulator charges it and the runtime sends it (:mod:`cocodiff.schedules.vmajor` says
which blocks are sent when).

A V row (one head of one rank's tokens, ``batch x local_tokens x head_dim`` values) is
cut into blocks of :func:`block_tokens` tokens of one sample. A partial message carries
the chosen blocks' values and one int32 index per block; both sides know how many blocks
it carries (:func:`blocks_sent`), so nothing else is sent. :func:`message_bytes` is the
size the simulator charges and the runtime sends.
"""

from __future__ import annotations

from cocodiff.plan.steps import HeadSplit

# Tokens per V-Major block: 4 KiB at head_dim 128 in bf16, against a 4-byte index.
BLOCK_TOKENS = 16
INDEX_BYTES = 4  # one int32 index per block of a partial message


def block_tokens(local_tokens: int, wanted: int = BLOCK_TOKENS) -> int:
    """The block length for rows of ``local_tokens`` tokens: the largest divisor of it
    not above ``wanted``, so that every block of a row has the same size."""
    return max(d for d in range(1, min(wanted, local_tokens) + 1) if local_tokens % d == 0)


def blocks_per_row(split: HeadSplit) -> int:
    """V-Major blocks in one row of ``split``'s exchanges."""
    return split.batch * (split.local_tokens // block_tokens(split.local_tokens))


def chunk_blocks_per_row(blocks_per_whole_row: int, row_tokens: int, tokens: int) -> int:
    """V-Major blocks in the part of a row that a chunk cutting tokens carries
    (``tokens`` of the row's ``row_tokens``): that part is cut into blocks of
    :func:`block_tokens` of its own tokens, per sample, as a whole row is."""
    batch = blocks_per_whole_row // (row_tokens // block_tokens(row_tokens))
    return batch * (tokens // block_tokens(tokens)) if tokens else 0


def blocks_sent(num_blocks: int, fraction: float) -> int:
    """Blocks a message of ``num_blocks`` carries when ``fraction`` of them is sent."""
    if fraction >= 1.0:
        return num_blocks
    return min(num_blocks, round(num_blocks * fraction))


def message_bytes(num_blocks: int, block_bytes: int, fraction: float) -> int:
    """Bytes of a V-Major message: the sent blocks, plus their indices unless it carries
    every block (then they come in order and no index is needed)."""
    sent = blocks_sent(num_blocks, fraction)
    return sent * block_bytes + (0 if sent == num_blocks else sent * INDEX_BYTES)

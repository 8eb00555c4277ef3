"""Ulysses x Ring x batch layouts on an unmodified diffusers model.

:func:`parallelize_hybrid` is :func:`cocodiff.runtime.parallel.parallelize` for a
:class:`~cocodiff.layout.ParallelLayout`:

* **batch**: the step's samples are cut into ``batch`` shares where they enter the
  transformer (the arguments its family's ``batch_arguments`` names, dim 0) and the output is
  gathered over the batch group where it leaves;
* **sequence**: each token stream is split over the ``ulysses * ring`` ranks of a batch
  group (the rank at ring index r, Ulysses index u holds chunk ``r * ulysses + u``) and
  gathered over them at the output projection, as pure Ulysses does over all ranks;
* **attention**: the plan (:func:`cocodiff.schedules.hybrid.plan_hybrid`) exchanges heads
  inside each Ulysses group as the named schedule does, then runs the Ring: the K/V block
  in hand goes to the next Ring member (an all-to-all over the Ring with one non-zero
  entry each way) while this rank attends to it; partial results are merged by their
  log-sum-exp (:func:`merge_partial`), in float32.

Exactness: each block's attention sees only real tokens (padding is never attended),
and the merge is exact up to float rounding, so the output equals single-process
diffusers within the flat plan's tolerance (``tests/runtime/test_runtime_hybrid.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from cocodiff.layout import LayoutError, ParallelLayout
from cocodiff.plan.steps import Exchange
from cocodiff.runtime.backend import TensorBackend, TimedHandle
from cocodiff.runtime.exchange import all_gather_rows
from cocodiff.runtime.hooks import install_processors, install_splits
from cocodiff.runtime.parallel import UlyssesRuntime, family_of
from cocodiff.runtime.tapa import Route, plan_route
from cocodiff.schedules import PlanOptions, RankGrid
from cocodiff.schedules.hybrid import ulysses_grids
from cocodiff.schedules.run_plan import Generation, RunPlan
from transports.base import Group, Handle, Transport

# torch's flash attention for CPU returns the log-sum-exp the Ring merge needs; checked
# once here rather than assumed (it is an internal op).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over one block of keys, with its log-sum-exp.

    Args:
        q: (B, Sq, h, D); k, v: (B, Sk, h, D).
        mask: None, or a boolean keep-mask / additive mask broadcastable to (B, h, Sq, Sk).

    Returns:
        out (B, h, Sq, D) and lse (B, h, Sq), both float32.
    """
    # (B, S, h, D) -> (B, h, S, D)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if mask is None and _FLASH_CPU is not None and q.device.type == "cpu":
        out, lse = _FLASH_CPU(qt, kt, vt)
        return out.float(), lse.float()
    scores = (qt.float() @ kt.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = torch.zeros_like(mask, dtype=scores.dtype).masked_fill(~mask, -torch.inf)
        scores = scores + mask.to(scores.dtype)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ vt.float()
    # A query whose keys in this block are all masked has lse -inf and a NaN row: it
    # contributes nothing to the merge.
    return out.masked_fill(torch.isneginf(lse).unsqueeze(-1), 0.0), lse


def merge_partial(acc: tuple[torch.Tensor, torch.Tensor] | None,
                  part: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint key sets:
    ``out = sum_i exp(lse_i - lse) out_i`` with ``lse = log(sum_i exp(lse_i))``."""
    if acc is None:
        return part
    (out_a, lse_a), (out_b, lse_b) = acc, part
    lse = torch.logaddexp(lse_a, lse_b)
    # A row that no key of either part reaches has lse -inf: weight 0, not NaN.
    weight_a = torch.exp(lse_a - lse).nan_to_num(0.0).unsqueeze(-1)
    weight_b = torch.exp(lse_b - lse).nan_to_num(0.0).unsqueeze(-1)
    return out_a * weight_a + out_b * weight_b, lse


def _restrict_mask(mask: torch.Tensor | None, q_orig: torch.Tensor,
                   k_orig: torch.Tensor) -> torch.Tensor | None:
    """The model's mask over the whole sequence (original order), cut to these queries
    and keys (broadcast dims stay)."""
    if mask is None:
        return None
    if mask.shape[-2] > 1:
        mask = mask.index_select(-2, q_orig)
    if mask.shape[-1] > 1:
        mask = mask.index_select(-1, k_orig)
    return mask


class HybridRuntime(UlyssesRuntime):
    """:class:`UlyssesRuntime` for a Ulysses x Ring x batch layout."""

    def __init__(self, transformer: torch.nn.Module, transport: Transport, family: Any,
                 schedule: str, parallel: ParallelLayout, grid: RankGrid | None = None,
                 options: PlanOptions | None = None, run_plan: RunPlan | None = None,
                 generation: Generation | None = None) -> None:
        self.parallel = parallel
        super().__init__(transformer, transport, family, schedule, grid, options, run_plan,
                         generation)
        me = self.grid.position(transport.rank)
        self.position = me
        self.ring_index = parallel.coords(me)[1]

        def ranks(positions) -> tuple[int, ...]:
            return tuple(self.grid.ranks[p] for p in positions)

        # new_group is collective over the world: every rank makes every group, in order.
        def make(groups_of: Callable[[int], tuple[int, ...]]) -> Group:
            every = sorted({ranks(groups_of(p)) for p in range(self.grid.num_ranks)})
            for group in every:
                if group not in self._groups:
                    self._groups[group] = transport.new_group(group)
            return self._groups[ranks(groups_of(me))]

        self._sequence_group = make(parallel.sequence_group)
        self.batch_group = make(parallel.batch_group)
        self.ulysses_grid = next(g for g in ulysses_grids(self.grid, parallel).values()
                                 if transport.rank in g.ranks)
        self._blocks: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def plan_batch(self, batch: int) -> int:
        # The attention call sees this batch group's samples; the plan counts them all.
        return batch * self.parallel.batch

    def ulysses_ranks(self, transport: Transport) -> int:
        self.parallel.check(transport.world_size, self.spec.num_heads, self.parallel.batch)
        return self.parallel.ulysses

    @property
    def sequence_index(self) -> int:
        return self.parallel.sequence_index(self.grid.position(self.transport.rank))

    @property
    def sequence_group(self) -> Group:
        return self._sequence_group

    @property
    def backend_type(self) -> type[TensorBackend]:
        return RingBackend

    def route(self, step: Exchange) -> Route:
        route = self._routes.get(step)
        if route is None:
            assert self.plan is not None
            route = self._routes[step] = plan_route(step, self.ulysses_grid,
                                                    self.plan.head_split.heads, self.transport.rank)
        return route

    def block_tokens(self, ring_index: int, streams: tuple[str, ...],
                     device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The real tokens of Ring member ``ring_index``'s block: their positions in the
        block (its Ulysses group's chunks, gathered) and in the whole sequence (streams
        concatenated in ``streams`` order, each without padding); on ``device``."""
        shards = [self.shards[name] for name in streams]
        key = (ring_index, tuple((s.total, s.chunk) for s in shards), str(device))
        if key not in self._blocks:
            local = sum(s.chunk for s in shards)
            positions, original = [], []
            for u in range(self.parallel.ulysses):
                chunk_index = ring_index * self.parallel.ulysses + u
                in_rank, in_sequence = 0, 0
                for shard in shards:
                    start = chunk_index * shard.chunk
                    real = torch.arange(max(0, min(shard.chunk, shard.total - start)))
                    positions.append(real + u * local + in_rank)
                    original.append(real + in_sequence + start)
                    in_rank += shard.chunk
                    in_sequence += shard.total
            self._blocks[key] = (torch.cat(positions).to(device),
                                 torch.cat(original).to(device))
        return self._blocks[key]


class RingBackend(TensorBackend):
    """:class:`TensorBackend` plus the Ring: K/V blocks passed on while the block in hand
    is attended to, partial results merged by log-sum-exp."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kv: torch.Tensor | None = None  # (2, B, S/ring, h, D): the block in hand
        self._block = 0  # blocks attended to so far
        self._partial: tuple[torch.Tensor, torch.Tensor] | None = None

    def _in_hand(self) -> torch.Tensor:
        if self._kv is None:
            tensors = self.state.tensors
            self._kv = torch.stack([tensors["k"], tensors["v"]])
        return self._kv

    def _attention(self) -> None:
        runtime: HybridRuntime = self.runtime  # type: ignore[assignment]
        ring = runtime.parallel.ring
        streams = self.ops.streams
        tensors = self.state.tensors
        source = (runtime.ring_index - self._block) % ring
        device = tensors["q"].device
        q_pos, q_orig = runtime.block_tokens(runtime.ring_index, streams, device)
        k_pos, k_orig = runtime.block_tokens(source, streams, device)
        kv = self._in_hand()
        if len(k_pos):  # a block of padding only adds nothing
            stream_tokens = tuple(runtime.shards[name].total for name in streams)
            mask = _restrict_mask(self.ops.attention_mask(self.state, stream_tokens),
                                  q_orig, k_orig)
            q = tensors["q"].index_select(1, q_pos)
            k, v = (kv[i].index_select(1, k_pos) for i in (0, 1))
            self._partial = merge_partial(self._partial, partial_attention(q, k, v, mask))
        self._block += 1
        if self._block == ring:
            q = tensors["q"]
            out = q.new_zeros(q.shape)
            if self._partial is not None:
                # (B, h, Sq, D) -> (B, Sq, h, D), padding positions stay zero
                out[:, q_pos] = self._partial[0].transpose(1, 2).to(q.dtype)
            tensors["out"] = out

    def start_exchange(self, step: Exchange, early: frozenset[int] = frozenset()) -> Handle:
        if step.direction != "ring":
            return super().start_exchange(step, early)
        runtime = self.runtime
        # (1, 2, B, S/ring, h, D): one row, the K and V block in hand
        send = self._in_hand().unsqueeze(0)
        row_bytes = send.numel() * send.element_size()
        if row_bytes != step.row_bytes:
            raise LayoutError(f"Ring pass: the plan moves a block of {step.row_bytes} B, the "
                              f"model has {row_bytes} B")
        self._record("exchange", step.tensor, row_bytes)
        runtime.exchanges_started += 1
        for member, rows in zip(step.group, step.send_rows, strict=True):
            if rows and member != runtime.transport.rank:
                runtime.count_sent(runtime.tier_to(member), rows * row_bytes)
        handle = runtime.transport.all_to_all(send, step.send_rows, step.recv_rows,
                                              runtime.group(step.group))
        return TimedHandle(handle, runtime)

    def finish_exchange(self, step: Exchange, received: torch.Tensor) -> None:
        if step.direction != "ring":
            super().finish_exchange(step, received)
            return
        self._kv = received[0]  # the previous member's block, now in hand


def _take(value: Any, full: int, index: int, parts: int) -> Any:
    """Share ``index`` of ``parts`` of a batched value (dim 0 of ``full`` samples)."""
    size = full // parts
    if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == full:
        return value.narrow(0, index * size, size)
    if isinstance(value, (list, tuple)) and len(value) == full:
        return type(value)(value[index * size:(index + 1) * size])
    if isinstance(value, dict):
        return {key: _take(item, full, index, parts) for key, item in value.items()}
    return value


def _install_batch_split(runtime: HybridRuntime) -> None:
    parallel = runtime.parallel
    if parallel.batch == 1:
        return
    transformer = runtime.transformer
    names = runtime.family.batch_arguments
    index = parallel.coords(runtime.position)[0]

    def split_batch(module, args, kwargs):
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
        full = bound.arguments["hidden_states"].shape[0]
        if full % parallel.batch:
            raise LayoutError(f"batch degree {parallel.batch} does not divide the {full} "
                              "sample(s) of this step")
        for name in names:
            if name in bound.arguments:
                bound.arguments[name] = _take(bound.arguments[name], full, index,
                                              parallel.batch)
        return bound.args, bound.kwargs

    def gather_batch(module, args, output):
        first = output[0] if isinstance(output, tuple) else output.sample
        # (parts, B/parts, ...) -> (B, ...)
        whole = all_gather_rows(runtime.transport, first.contiguous(),
                                runtime.batch_group).flatten(0, 1)
        runtime.count_gathered(runtime.batch_group, first.numel() * first.element_size())
        if isinstance(output, tuple):
            return (whole, *output[1:])
        output.sample = whole
        return output

    transformer.register_forward_pre_hook(split_batch, with_kwargs=True, prepend=True)
    transformer.register_forward_hook(gather_batch)


def parallelize_hybrid(model: Any, transport: Transport, schedule: str,
                       parallel: ParallelLayout, grid: RankGrid | None = None, *,
                       options: PlanOptions | None = None,
                       run_plan: RunPlan | None = None,
                       generation: Generation | None = None) -> HybridRuntime:
    """:func:`~cocodiff.runtime.parallel.parallelize` with a Ulysses x Ring x batch
    layout. Every rank calls it with the same arguments.

    Args:
        model: a diffusers pipeline or transformer.
        transport: the transport over every rank of the job.
        schedule: the Ulysses schedule inside each Ulysses group.
        parallel: the layout; its degrees must multiply to the rank count.
        grid: where the ranks sit (None: one node of P GPUs).
        options: chunks and V-Major's options (as :func:`parallelize`).
        run_plan: a plan file's plan to execute instead (as :func:`parallelize`).
        generation: the model's spec and image size the plans record (as
            :func:`parallelize`).

    Raises:
        LayoutError: the layout does not fit the job or the model.
    """
    transformer = getattr(model, "transformer", model)
    runtime = HybridRuntime(transformer, transport, family_of(transformer), schedule,
                            parallel, grid, options, run_plan, generation)
    _install_batch_split(runtime)
    install_splits(runtime)
    install_processors(runtime)
    return runtime

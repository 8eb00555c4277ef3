"""The runtime's executor backend: plan steps bound to one attention call's tensors.

The shared executor (:mod:`cocodiff.plan.executor`) walks a layer's attention steps and
asks a backend to carry each one out; here compute steps are the model's own operations
and exchanges go through the transport (flat, or as TAPA's phases through
:class:`~cocodiff.runtime.tapa.PhasedHandle`), counting the bytes each link tier
carries, as the simulator's backend does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from cocodiff.plan.executor import PlanError
from cocodiff.plan.steps import Compute, Exchange
from cocodiff.runtime.exchange import (
    pack_gather_heads,
    pack_scatter_heads,
    unpack_gather_heads,
    unpack_scatter_heads,
)
from cocodiff.runtime.families.base import AttentionOps, AttentionState
from cocodiff.runtime.tapa import PhasedExchanges, PhasedHandle
from transports.base import CompletedHandle, Handle

if TYPE_CHECKING:
    from cocodiff.runtime.parallel import UlyssesRuntime

# The tier (a topology.TIERS name) that messages between ranks differing first in this
# level cross: the runtime counts its bytes per tier, as the simulator does.
LEVEL_TIERS = {"node": "inter-node", "gpu": "intra-node", "tile": "intra-gpu"}


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What the runtime did, for comparing with the plan: ("compute", op, 0) or
    ("exchange", tensor, bytes sent)."""

    kind: str
    name: str
    num_bytes: int


class TimedHandle:
    """A transport handle whose ``wait()`` adds its blocking time to the runtime's
    ``comm_s``: the communication time the rank actually waited for."""

    __slots__ = ("_handle", "_runtime")

    def __init__(self, handle: Handle, runtime: UlyssesRuntime) -> None:
        self._handle = handle
        self._runtime = runtime

    def is_completed(self) -> bool:
        return self._handle.is_completed()

    def wait(self) -> Any:
        start = time.perf_counter()
        try:
            return self._handle.wait()
        finally:
            self._runtime.comm_s += time.perf_counter() - start


class TensorBackend:
    """Binds plan steps to one attention call's tensors and the transport."""

    def __init__(self, runtime: UlyssesRuntime, ops: AttentionOps, state: AttentionState,
                 layer_index: int) -> None:
        self.runtime = runtime
        self.ops = ops
        self.state = state
        self.layer_index = layer_index
        self.phased = PhasedExchanges()

    def _record(self, kind: str, name: str, num_bytes: int = 0) -> None:
        if self.runtime.records is not None:
            self.runtime.records.append(StepRecord(kind, name, num_bytes))

    def compute(self, step: Compute) -> Handle:
        if step.op == "attention":
            self._attention()
        else:
            getattr(self.ops, step.op)(self.state)
        self._record("compute", step.op)
        return CompletedHandle()

    def _attention(self) -> None:
        # Pick the real tokens in the model's original order out of the gathered
        # sequence, so the kernel sees exactly the single-process input (no padding).
        # The mask is the model's own, over that same sequence.
        tensors = self.state.tensors
        positions = self.runtime.original_positions(self.ops.streams, tensors["q"].device)
        stream_tokens = tuple(self.runtime.shards[name].total for name in self.ops.streams)
        q, k, v = (tensors[name].index_select(1, positions) for name in ("q", "k", "v"))
        mask = self.ops.attention_mask(self.state, stream_tokens)
        out = dispatch_attention_fn(q, k, v, attn_mask=mask)
        gathered = out.new_zeros(tensors["q"].shape)
        gathered[:, positions] = out
        tensors["out"] = gathered

    def progress(self) -> None:
        self.phased.progress()

    def start_exchange(self, step: Exchange, early: frozenset[int] = frozenset()) -> Handle:
        self.runtime.exchanges_started += 1
        x = self.state.tensors[step.tensor]
        group = self.runtime.group(step.group)
        if step.direction == "scatter_heads":
            send = pack_scatter_heads(x)
        else:
            send = pack_gather_heads(x, group.size)
        row_bytes = send[0].numel() * send.element_size()
        if row_bytes != step.row_bytes or send.shape[0] != sum(step.send_rows):
            raise PlanError(
                f"exchange of {step.tensor}: the plan moves {sum(step.send_rows)} rows of "
                f"{step.row_bytes} B, the model has {send.shape[0]} rows of {row_bytes} B"
            )
        self._record("exchange", step.tensor, send.numel() * send.element_size())
        runtime = self.runtime
        if step.phases:
            # The rows go through the phases' sub-groups; the handle delivers them in the
            # flat all-to-all's layout, so finish_exchange is the same for both.
            groups = [runtime.group(phase.group) for phase in step.phases]
            codecs = {
                index: runtime.vcache.codec(step.tensor, runtime.step, runtime.call,
                                            self.layer_index, phase.sent_fraction,
                                            phase.blocks_per_row, sum(step.chunk_tokens))
                for index, phase in enumerate(step.phases) if phase.selective
            }
            tiers = [LEVEL_TIERS[phase.level] for phase in step.phases]
            handle: Handle = PhasedHandle(
                runtime.transport, groups, runtime.route(step), send, step.chunks, codecs,
                on_sent=lambda phase, num_bytes: runtime.count_sent(tiers[phase], num_bytes),
                early=early, exchanges=self.phased, chunk_tokens=step.chunk_tokens,
            )
        else:
            for member, rows in zip(step.group, step.send_rows, strict=True):
                if member != runtime.transport.rank:
                    runtime.count_sent(runtime.tier_to(member), rows * row_bytes)
            handle = runtime.transport.all_to_all(send, step.send_rows, step.recv_rows, group)
        return TimedHandle(handle, runtime)

    def finish_exchange(self, step: Exchange, received: torch.Tensor) -> None:
        if step.direction == "scatter_heads":
            self.state.tensors[step.tensor] = unpack_scatter_heads(received, len(step.group))
        else:
            self.state.tensors[step.tensor] = unpack_gather_heads(received)

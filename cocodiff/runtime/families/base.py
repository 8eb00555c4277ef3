"""What the runtime must know about a diffusers model family, as data plus a few ops.

A family says where the token streams enter the model and leave it (:class:`Split`,
:class:`Gather`: our counterpart of diffusers' ``_cp_plan``), which attention
processors it replaces, and how the plan's compute steps map onto the model's own
modules (:class:`AttentionOps`). The model's code is never changed.

Module names are dotted paths inside the transformer ("" is the transformer itself);
where a pattern is allowed, each dot-separated part may be an ``fnmatch`` pattern
matching exactly one part ("transformer_blocks.*" is every block, not their children).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Protocol

import torch


@dataclass(frozen=True, slots=True)
class Split:
    """Split a module's input argument (or, with ``output``, an element of its output
    tuple) along ``dim`` as token stream ``stream``.

    ``module`` is a module name pattern (every matching module is hooked); ``argument`` a
    parameter name of its forward, or an output index (a module returning one tensor
    counts as returning a 1-tuple). With ``ndim``, only a tensor of that many dimensions
    is split (diffusers' ``expected_dims``): others pass through whole.
    """

    module: str
    argument: str | int
    dim: int
    stream: str
    output: bool = False
    ndim: int | None = None


@dataclass(frozen=True, slots=True)
class Gather:
    """All-gather a module's output along ``dim`` (stream ``stream``), removing padding."""

    module: str
    dim: int
    stream: str


@dataclass(slots=True)
class AttentionState:
    """One attention call in flight: its inputs and the tensors the plan steps make.

    ``extra`` holds "rotary_emb" (the rotary embedding of the local tokens, under
    whichever name the model passes it) and "encoder_hidden_states_mask" (as given: all
    text tokens, not split). ``tensors`` holds "q", "k", "v" ((B, s, H, D) local tokens
    before the exchange, (B, S, h, D) after) and "out".
    """

    attn: Any
    hidden_states: torch.Tensor
    encoder_hidden_states: torch.Tensor | None
    attention_mask: torch.Tensor | None
    extra: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    result: Any = None


class AttentionOps(Protocol):
    """The model-specific compute steps of one attention call.

    Attributes:
        streams: stream names in the order the attention concatenates them.
        processor_classes: class names of the diffusers processors this replaces.
    """

    streams: tuple[str, ...]
    processor_classes: tuple[str, ...]

    def proj_q(self, state: AttentionState) -> None: ...
    def proj_k(self, state: AttentionState) -> None: ...
    def proj_v(self, state: AttentionState) -> None: ...
    def qk_norm(self, state: AttentionState) -> None: ...
    def rope(self, state: AttentionState) -> None: ...
    def attention_mask(
        self, state: AttentionState, stream_tokens: tuple[int, ...]
    ) -> torch.Tensor | None:
        """The mask the model's own processor would give the attention kernel: over the
        whole sequence (``stream_tokens``: each stream's real tokens, in ``streams``
        order) in the model's original order, or None. The runtime runs the kernel on
        exactly that sequence, so the mask needs no padding or permutation."""
        ...
    def proj_out(self, state: AttentionState) -> None:
        """Turn ``tensors["out"]`` ((B, s, H, D) local tokens) into ``state.result``."""
        ...


@dataclass(frozen=True, slots=True)
class Family:
    """Everything the runtime needs for one model family (its record,
    :class:`cocodiff.models.ModelFamily`, names the transformer classes).

    ``batch_arguments``: the transformer forward's arguments that carry the batch in dim
    0 (a tensor whose dim 0 is the batch, or a list with one entry per sample; dicts are
    searched), which a batch-parallel layout cuts. ``decode``: turns the first sample of
    ``run_pipeline``'s latents into pixels, as the pipeline itself would.
    ``attention_modules``: a module name pattern limiting which attention modules get
    the parallel processor (self-attention, not the cross-attention next to it); None
    for every module with one of ``ops.processor_classes``.
    """

    splits: tuple[Split, ...]
    gathers: tuple[Gather, ...]
    ops: AttentionOps
    batch_arguments: tuple[str, ...]
    decode: Callable[[Any, torch.Tensor], Any]
    attention_modules: str | None = None


def module_matches(name: str, pattern: str) -> bool:
    """Whether module ``name`` matches ``pattern`` part by dotted part."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(map(fnmatchcase, parts, wanted))


class JointAttentionOps:
    """Q/K/V projections and per-stream Q/K norms, shared by every family.

    MMDiT-style families (FLUX, SD3, Qwen-Image): image and text tokens have their own
    projections and norms, and attend jointly, concatenated in ``streams`` order. A call
    without a text stream (FLUX's single-stream blocks, PixArt's and Wan's
    self-attention) projects its one sequence with the image weights.

    Subclasses set ``streams`` and ``processor_classes`` and supply ``rope``,
    ``attention_mask`` and ``proj_out``.
    """

    streams: tuple[str, ...]
    processor_classes: tuple[str, ...]

    def text_tokens(self, state: AttentionState) -> int:
        """Local text tokens in this call; 0 when the block has no separate text stream."""
        joint = (state.encoder_hidden_states is not None
                 and getattr(state.attn, "added_kv_proj_dim", None))
        return state.encoder_hidden_states.shape[1] if joint else 0

    def _project(self, state: AttentionState, image_proj: str, text_proj: str) -> torch.Tensor:
        attn = state.attn
        # (B, s, H*D) -> (B, s, H, D)
        image = getattr(attn, image_proj)(state.hidden_states).unflatten(-1, (attn.heads, -1))
        if not self.text_tokens(state):
            return image
        text = getattr(attn, text_proj)(state.encoder_hidden_states)
        parts = {"image": image, "text": text.unflatten(-1, (attn.heads, -1))}
        return torch.cat([parts[stream] for stream in self.streams], dim=1)

    def proj_q(self, state: AttentionState) -> None:
        state.tensors["q"] = self._project(state, "to_q", "add_q_proj")

    def proj_k(self, state: AttentionState) -> None:
        state.tensors["k"] = self._project(state, "to_k", "add_k_proj")

    def proj_v(self, state: AttentionState) -> None:
        state.tensors["v"] = self._project(state, "to_v", "add_v_proj")

    def qk_norm(self, state: AttentionState) -> None:
        # Per-head norms over head_dim act per token, so norming each stream's slice of
        # the concatenation gives the processor's values. A norm the module lacks (None)
        # is skipped, as the processor skips it.
        attn = state.attn
        text = self.text_tokens(state)
        for name, image_norm, text_norm in (("q", attn.norm_q, "norm_added_q"),
                                            ("k", attn.norm_k, "norm_added_k")):
            x = state.tensors[name]
            if not text:
                state.tensors[name] = image_norm(x) if image_norm is not None else x
                continue
            norms = {"image": image_norm, "text": getattr(attn, text_norm, None)}
            sizes = {"image": x.shape[1] - text, "text": text}
            parts = x.split_with_sizes([sizes[stream] for stream in self.streams], dim=1)
            state.tensors[name] = torch.cat(
                [norms[stream](part) if norms[stream] is not None else part
                 for stream, part in zip(self.streams, parts, strict=True)], dim=1)

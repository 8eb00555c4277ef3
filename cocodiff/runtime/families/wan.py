"""Wan 2.1 / 2.2 (WanTransformer3DModel, WanAttnProcessor): each block's self-attention
``attn1`` runs Ulysses-parallel over the video tokens, with RMS Q/K norms across all
heads and a 3D rotary embedding; its cross-attention ``attn2`` keeps its own processor
and needs no communication (local queries, whole text and image context on every rank).

Split points as diffusers' ``_cp_plan``: the rotary embedding's (cos, sin) outputs, the
first block's input, and Wan 2.2 TI2V's per-token timesteps; the output projection is
gathered.
"""

from __future__ import annotations

import torch

from cocodiff.runtime.families.base import AttentionState, Family, Gather, JointAttentionOps, Split
from cocodiff.runtime.families.decode import decode_wan


def _apply_rotary_emb(x: torch.Tensor, freqs_cos: torch.Tensor,
                      freqs_sin: torch.Tensor) -> torch.Tensor:
    # WanAttnProcessor's own (local) function: interleaved pairs, float64 tables.
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class WanOps(JointAttentionOps):
    streams = ("image",)
    processor_classes = ("WanAttnProcessor",)

    def qk_norm(self, state: AttentionState) -> None:
        # The norm spans all heads of one token, so it runs before the head exchange,
        # on the whole (H*D) vector: (B, s, H, D) -> (B, s, H*D) -> norm -> (B, s, H, D).
        attn = state.attn
        for name, norm in (("q", attn.norm_q), ("k", attn.norm_k)):
            x = state.tensors[name]
            state.tensors[name] = norm(x.flatten(2, 3)).unflatten(2, (attn.heads, -1))

    def rope(self, state: AttentionState) -> None:
        rotary = state.extra["rotary_emb"]
        if rotary is None:
            return
        for name in ("q", "k"):
            state.tensors[name] = _apply_rotary_emb(state.tensors[name], *rotary)

    def attention_mask(
        self, state: AttentionState, stream_tokens: tuple[int, ...]
    ) -> torch.Tensor | None:
        return state.attention_mask  # the processor hands it to the kernel as given (None)

    def proj_out(self, state: AttentionState) -> None:
        attn = state.attn
        # (B, s, H, D) -> (B, s, H*D)
        out = state.tensors["out"].flatten(2, 3).type_as(state.tensors["q"])
        state.result = attn.to_out[1](attn.to_out[0](out))


WAN = Family(
    splits=(
        Split("", "timestep", 1, "image", ndim=2),  # Wan 2.2 TI2V: one timestep per token
        Split("rope", 0, 1, "image", output=True),  # (1, S, 1, D) cos
        Split("rope", 1, 1, "image", output=True),  # (1, S, 1, D) sin
        Split("blocks.0", "hidden_states", 1, "image"),
    ),
    gathers=(Gather("proj_out", 1, "image"),),
    ops=WanOps(),
    batch_arguments=("hidden_states", "encoder_hidden_states", "timestep",
                     "encoder_hidden_states_image"),
    decode=decode_wan,
    attention_modules="blocks.*.attn1",
)

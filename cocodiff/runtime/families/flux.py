"""FLUX.1 (FluxTransformer2DModel): double-stream blocks attend over [text, image]
with separate projections per stream; single-stream blocks get [text, image] already
concatenated. RoPE positions come from ``txt_ids``/``img_ids``, split with the tokens,
so each rank computes the rotary embedding of its own tokens."""

from __future__ import annotations

import torch
from diffusers.models.embeddings import apply_rotary_emb

from cocodiff.runtime.families.base import (
    AttentionState,
    Family,
    Gather,
    JointAttentionOps,
    Split,
)
from cocodiff.runtime.families.decode import decode_kl


class FluxOps(JointAttentionOps):
    streams = ("text", "image")
    processor_classes = ("FluxAttnProcessor",)

    def rope(self, state: AttentionState) -> None:
        rotary = state.extra["rotary_emb"]
        if rotary is None:
            return
        for name in ("q", "k"):
            state.tensors[name] = apply_rotary_emb(state.tensors[name], rotary, sequence_dim=1)

    def attention_mask(
        self, state: AttentionState, stream_tokens: tuple[int, ...]
    ) -> torch.Tensor | None:
        return state.attention_mask  # FluxAttnProcessor hands it to the kernel as given

    def proj_out(self, state: AttentionState) -> None:
        attn = state.attn
        out = state.tensors["out"].flatten(2, 3).to(state.tensors["q"].dtype)
        text = self.text_tokens(state)
        if not text:
            state.result = out  # single-stream block: its own proj_out runs in the block
            return
        context, image = out.split_with_sizes([text, out.shape[1] - text], dim=1)
        image = attn.to_out[1](attn.to_out[0](image.contiguous()))
        state.result = (image, attn.to_add_out(context.contiguous()))


FLUX = Family(
    splits=(
        Split("", "hidden_states", 1, "image"),
        Split("", "encoder_hidden_states", 1, "text"),
        Split("", "img_ids", 0, "image"),
        Split("", "txt_ids", 0, "text"),
    ),
    gathers=(Gather("proj_out", 1, "image"),),
    ops=FluxOps(),
    batch_arguments=("hidden_states", "encoder_hidden_states", "pooled_projections",
                     "timestep", "guidance"),
    decode=decode_kl,
)

"""Stable Diffusion 3 / 3.5 (SD3Transformer2DModel, JointAttnProcessor2_0): MMDiT blocks
attend over [image, text] with separate projections (and Q/K norms, in SD3.5) per
stream. No RoPE: positions are added once, in ``pos_embed``, before the split.

The streams are split where they are made (the patch embedding and the context
embedder), so ``skip_layers`` may skip any block. The last block is
``context_pre_only``: its text attention output is returned unprojected and the block
drops it. SD3.5-medium's dual-attention blocks (a second, image-only ``attn2`` with the
same processor) are not supported: ``parallelize`` finds more processors than layers and
refuses.
"""

from __future__ import annotations

import torch

from cocodiff.runtime.families.base import (
    AttentionState,
    Family,
    Gather,
    JointAttentionOps,
    Split,
)
from cocodiff.runtime.families.decode import decode_kl


class SD3Ops(JointAttentionOps):
    streams = ("image", "text")
    processor_classes = ("JointAttnProcessor2_0",)

    def rope(self, state: AttentionState) -> None:
        """SD3 has no rotary embedding (``ModelSpec.has_rope`` is False)."""

    def attention_mask(
        self, state: AttentionState, stream_tokens: tuple[int, ...]
    ) -> torch.Tensor | None:
        return None  # JointAttnProcessor2_0 ignores attention_mask

    def proj_out(self, state: AttentionState) -> None:
        attn = state.attn
        # (B, s, H, D) -> (B, s, H*D)
        out = state.tensors["out"].flatten(2, 3).to(state.tensors["q"].dtype)
        if state.encoder_hidden_states is None:
            state.result = attn.to_out[1](attn.to_out[0](out))
            return
        image = state.hidden_states.shape[1]
        out, context = out[:, :image], out[:, image:]
        if not attn.context_pre_only:
            context = attn.to_add_out(context)
        state.result = (attn.to_out[1](attn.to_out[0](out)), context)


SD3 = Family(
    splits=(
        Split("pos_embed", 0, 1, "image", output=True),
        Split("context_embedder", 0, 1, "text", output=True),
    ),
    gathers=(Gather("proj_out", 1, "image"),),
    ops=SD3Ops(),
    batch_arguments=("hidden_states", "encoder_hidden_states", "pooled_projections",
                     "timestep"),
    decode=decode_kl,
)

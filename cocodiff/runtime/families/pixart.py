"""PixArt-Alpha / Sigma (PixArtTransformer2DModel): each block's self-attention
``attn1`` (AttnProcessor2_0) runs Ulysses-parallel over the image tokens; its
cross-attention ``attn2`` keeps its own processor and needs no communication: local
image queries attend to the whole text, which every rank holds. No Q/K norm, no RoPE
(positions are added once, in ``pos_embed``, before the split)."""

from __future__ import annotations

import torch

from cocodiff.runtime.families.base import AttentionState, Family, Gather, JointAttentionOps, Split
from cocodiff.runtime.families.decode import decode_kl


class PixArtOps(JointAttentionOps):
    streams = ("image",)
    processor_classes = ("AttnProcessor2_0",)

    def rope(self, state: AttentionState) -> None:
        """PixArt has no rotary embedding (``ModelSpec.has_rope`` is False)."""

    def attention_mask(
        self, state: AttentionState, stream_tokens: tuple[int, ...]
    ) -> torch.Tensor | None:
        # The transformer turns a (B, S) keep-mask over the image tokens into a bias
        # (B, 1, S) (or is given a (B, S, S) one); the processor repeats it per head,
        # (B, H, 1 or S, S). One copy broadcasts over this rank's heads. It stays whole:
        # the block hands attn1 the unsplit mask, and the kernel sees all S tokens.
        mask = state.attention_mask
        return None if mask is None else mask.unsqueeze(1)

    def proj_out(self, state: AttentionState) -> None:
        attn = state.attn
        # (B, s, H, D) -> (B, s, H*D)
        out = state.tensors["out"].flatten(2, 3).to(state.tensors["q"].dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        if attn.residual_connection:
            out = out + state.hidden_states
        state.result = out / attn.rescale_output_factor


PIXART = Family(
    splits=(Split("pos_embed", 0, 1, "image", output=True),),
    gathers=(Gather("proj_out", 1, "image"),),
    ops=PixArtOps(),
    batch_arguments=("hidden_states", "encoder_hidden_states", "encoder_attention_mask",
                     "timestep", "added_cond_kwargs"),
    decode=decode_kl,
    attention_modules="transformer_blocks.*.attn1",
)

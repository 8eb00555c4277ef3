"""Qwen-Image (QwenImageTransformer2DModel, QwenDoubleStreamAttnProcessor2_0):
double-stream blocks attend over [text, image] with separate projections, per-head RMS
Q/K norms per stream and complex rotary embeddings (image and text tables from
``pos_embed``).

Split points as diffusers' ``_cp_plan``: the first block's two streams (after the
transformer has checked the text mask against the whole text and sized the text RoPE
table by it), both ``pos_embed`` tables, and each block's ``modulate_index`` (per image
token, with ``zero_cond_t``). The output projection is gathered.

The text mask (``encoder_hidden_states_mask``) is *not* split: every rank holds it
whole, and the joint mask is built exactly as the processor builds it, over the whole
[text, image] sequence in original order, which is the sequence the runtime's kernel
sees. So padding tokens of the split never meet the mask, and it needs no exchange.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

from cocodiff.runtime.families.base import (
    AttentionState,
    Family,
    Gather,
    JointAttentionOps,
    Split,
)
from cocodiff.runtime.families.decode import decode_qwen


class QwenOps(JointAttentionOps):
    streams = ("text", "image")
    processor_classes = ("QwenDoubleStreamAttnProcessor2_0",)

    def rope(self, state: AttentionState) -> None:
        rotary = state.extra["rotary_emb"]
        if rotary is None:
            return
        image_freqs, text_freqs = rotary  # this rank's rows of each table
        text = state.encoder_hidden_states.shape[1]
        for name in ("q", "k"):
            x = state.tensors[name]
            state.tensors[name] = torch.cat(
                [apply_rotary_emb_qwen(x[:, :text], text_freqs, use_real=False),
                 apply_rotary_emb_qwen(x[:, text:], image_freqs, use_real=False)],
                dim=1,
            )

    def attention_mask(
        self, state: AttentionState, stream_tokens: tuple[int, ...]
    ) -> torch.Tensor | None:
        if state.attention_mask is not None:
            raise ValueError(
                "QwenDoubleStreamAttnProcessor2_0 does not accept an external attention_mask. "
                "Pass encoder_hidden_states_mask to let the processor build the joint mask."
            )
        text_mask = state.extra["encoder_hidden_states_mask"]  # (B, T) bool, all text
        if text_mask is None:
            return None
        _text_tokens, image_tokens = stream_tokens
        image_mask = torch.ones((text_mask.shape[0], image_tokens), dtype=torch.bool,
                                device=text_mask.device)
        # (B, T + I) -> (B, 1, 1, T + I): every query sees the same keys
        return torch.cat([text_mask, image_mask], dim=1)[:, None, None, :]

    def proj_out(self, state: AttentionState) -> None:
        attn = state.attn
        # (B, s, H, D) -> (B, s, H*D)
        out = state.tensors["out"].flatten(2, 3).to(state.tensors["q"].dtype)
        text = state.encoder_hidden_states.shape[1]
        context, image = out[:, :text], out[:, text:]
        image = attn.to_out[0](image.contiguous())
        if len(attn.to_out) > 1:
            image = attn.to_out[1](image)  # dropout
        state.result = (image, attn.to_add_out(context.contiguous()))


QWEN = Family(
    splits=(
        Split("transformer_blocks.0", "hidden_states", 1, "image"),
        Split("transformer_blocks.0", "encoder_hidden_states", 1, "text"),
        Split("transformer_blocks.*", "modulate_index", 1, "image"),
        Split("pos_embed", 0, 0, "image", output=True),  # (I, D/2) complex
        Split("pos_embed", 1, 0, "text", output=True),  # (T, D/2) complex
    ),
    gathers=(Gather("proj_out", 1, "image"),),
    ops=QwenOps(),
    batch_arguments=("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask",
                     "timestep", "guidance", "img_shapes", "txt_seq_lens"),
    decode=decode_qwen,
)

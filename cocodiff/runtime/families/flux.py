"""FLUX.1 (FluxTransformer2DModel): double-stream blocks attend over [text, image]
with separate projections per stream; single-stream blocks get [text, image] already
concatenated. RoPE positions come from ``txt_ids``/``img_ids``, split with the tokens,
so each rank computes the rotary embedding of its own tokens."""

from __future__ import annotations

import torch
from diffusers.models.embeddings import apply_rotary_emb

from cocodiff.runtime.families.base import AttentionState, Family, Gather, Split


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    # (B, s, H*D) -> (B, s, H, D)
    return x.unflatten(-1, (-1, head_dim))


class FluxOps:
    streams = ("text", "image")
    processor_classes = ("FluxAttnProcessor",)

    def _project(self, state: AttentionState, image_proj: str, text_proj: str) -> torch.Tensor:
        attn = state.attn
        x = _heads(getattr(attn, image_proj)(state.hidden_states), attn.head_dim)
        if state.encoder_hidden_states is None or attn.added_kv_proj_dim is None:
            return x
        context = _heads(getattr(attn, text_proj)(state.encoder_hidden_states), attn.head_dim)
        return torch.cat([context, x], dim=1)

    def proj_q(self, state: AttentionState) -> None:
        state.tensors["q"] = self._project(state, "to_q", "add_q_proj")

    def proj_k(self, state: AttentionState) -> None:
        state.tensors["k"] = self._project(state, "to_k", "add_k_proj")

    def proj_v(self, state: AttentionState) -> None:
        state.tensors["v"] = self._project(state, "to_v", "add_v_proj")

    def qk_norm(self, state: AttentionState) -> None:
        # RMSNorm over head_dim is per token, so norming each stream's slice of the
        # concatenation gives the same values as norming before concatenating.
        attn = state.attn
        text = self._text_tokens(state)
        for name, image_norm, text_norm in (("q", attn.norm_q, "norm_added_q"),
                                            ("k", attn.norm_k, "norm_added_k")):
            x = state.tensors[name]
            if text:
                x = torch.cat([getattr(attn, text_norm)(x[:, :text]), image_norm(x[:, text:])],
                              dim=1)
            else:
                x = image_norm(x)
            state.tensors[name] = x

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
        text = self._text_tokens(state)
        if not text:
            state.result = out  # single-stream block: its own proj_out runs in the block
            return
        context, image = out.split_with_sizes([text, out.shape[1] - text], dim=1)
        image = attn.to_out[1](attn.to_out[0](image.contiguous()))
        state.result = (image, attn.to_add_out(context.contiguous()))

    @staticmethod
    def _text_tokens(state: AttentionState) -> int:
        joint = state.encoder_hidden_states is not None and state.attn.added_kv_proj_dim
        return state.encoder_hidden_states.shape[1] if joint else 0


FLUX = Family(
    transformer_class="FluxTransformer2DModel",
    splits=(
        Split("", "hidden_states", 1, "image"),
        Split("", "encoder_hidden_states", 1, "text"),
        Split("", "img_ids", 0, "image"),
        Split("", "txt_ids", 0, "text"),
    ),
    gathers=(Gather("proj_out", 1, "image"),),
    ops=FluxOps(),
)

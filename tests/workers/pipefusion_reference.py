"""PipeFusion's pipelined steps in one process, serially: the reference the parallel
runtime (``cocodiff.runtime.pipefusion``) is checked against, since the stale K/V makes
it differ from plain diffusers.

The algorithm (xDiT's, arXiv 2405.14430), for N stages and M patches after ``warmup``
synchronous steps:

* a synchronous step is the plain model; each attention layer keeps K and V of all
  image tokens (its buffer);
* a pipelined step runs the patches one after the other, each through every layer
  (patch-major: a layer's buffer then holds this step's K/V for the patches before and
  the step before's for the patches after, the same state the pipeline gives it, since
  each buffer belongs to one layer). A patch's attention writes its K/V into the buffer,
  then its queries (image rows of the patch and the whole text) attend to the whole
  text's fresh K/V and the whole image's buffer;
* the joint text goes through the blocks with every patch, but the text entering stage
  s+1 is what stage s gave patch 0 (the pipeline sends the text once per step);
* with Ulysses U inside each stage, patch m is the m-th slice of each of the U equal
  shards of the image (each stage rank cuts its own tokens into patches).

The Q/K/V projections, norms, RoPE and output projections are the model's own ops, as
the runtime's families give them (the exact parity tests check those against diffusers).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from cocodiff.runtime.families.base import AttentionState, module_matches
from cocodiff.runtime.parallel import family_of
from cocodiff.runtime.pipefusion import BLOCK_OUTPUTS, TOKEN_ARGUMENTS


def patch_image_rows(image_tokens: int, ulysses: int, patches: int, patch: int) -> torch.Tensor:
    """The image rows of patch ``patch``: its slice of each Ulysses shard."""
    shard = image_tokens // ulysses
    per_patch = shard // patches
    return (torch.arange(ulysses)[:, None] * shard + patch * per_patch
            + torch.arange(per_patch)[None]).reshape(-1)


class StaleKV:
    """One transformer emulating PipeFusion with ``stage_layers`` (layer bounds of each
    stage, as :meth:`PipelineLayout.stage_layers` gives), ``patches`` and ``warmup``."""

    def __init__(self, transformer: torch.nn.Module, stage_layers: list[int], patches: int,
                 warmup: int, ulysses: int) -> None:
        self.transformer = transformer
        self.family = family_of(transformer)
        self.stage_layers = stage_layers
        self.patches, self.warmup, self.ulysses = patches, warmup, ulysses
        self.step = -1
        self.patch: int | None = None
        self.text_tokens = 0
        self.image_tokens = 0
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        ops, pattern = self.family.ops, self.family.attention_modules
        names = []
        for name, module in transformer.named_modules():
            processor = getattr(module, "processor", None)
            if processor is None or type(processor).__name__ not in ops.processor_classes:
                continue
            if pattern is None or module_matches(name, pattern):
                module.set_processor(_Processor(self, len(names)))
                names.append(name.rsplit(".", 1)[0])
        self.blocks = [transformer.get_submodule(name) for name in names]
        for index, name in enumerate(names):
            parent, _, child = name.rpartition(".")
            setattr(transformer.get_submodule(parent) if parent else transformer, child,
                    _Block(self, self.blocks[index], index))
        transformer.register_forward_pre_hook(self._begin)
        self.payload: Any = None

    def start_generation(self) -> None:
        self.step = -1
        self.buffers.clear()

    def _begin(self, module, args) -> None:
        self.step += 1
        self.payload = None

    @property
    def pipelined(self) -> bool:
        return self.step >= self.warmup

    def run_patches(self, arguments: dict[str, Any]) -> Any:
        """Every block on each patch in turn; the image rows put back in place."""
        joint = len(BLOCK_OUTPUTS[type(self.transformer).__name__]) == 2
        hidden = arguments["hidden_states"]
        text = arguments.get("encoder_hidden_states") if joint else None
        self.text_tokens = text.shape[1] if text is not None else 0
        self.image_tokens = hidden.shape[1]
        image_out = torch.empty_like(hidden)
        stage_text: dict[int, torch.Tensor] = {}
        final_text = None
        for m in range(self.patches):
            rows = patch_image_rows(self.image_tokens, self.ulysses, self.patches, m)
            call = dict(arguments, hidden_states=hidden[:, rows])
            for name in TOKEN_ARGUMENTS[type(self.transformer).__name__]:
                value = call.get(name)
                if value is not None:
                    picked = torch.cat([torch.arange(self.text_tokens),
                                        self.text_tokens + rows])
                    call[name] = tuple(part[picked] for part in value)
            self.patch = m
            for stage in range(len(self.stage_layers) - 1):
                if joint:
                    # Stage 0 gets the model's text; a later stage what the stage before
                    # gave patch 0.
                    call["encoder_hidden_states"] = text if stage == 0 else stage_text[stage - 1]
                for index in range(self.stage_layers[stage], self.stage_layers[stage + 1]):
                    out = self.blocks[index](**call)
                    if joint:
                        call["encoder_hidden_states"], call["hidden_states"] = out
                    else:
                        call["hidden_states"] = out
                if joint and m == 0:
                    stage_text[stage] = call["encoder_hidden_states"]
            self.patch = None
            image_out[:, rows] = call["hidden_states"]
            if m == 0 and joint:
                final_text = call["encoder_hidden_states"]
        return (final_text, image_out) if joint else image_out


class _Block(torch.nn.Module):
    def __init__(self, emulation: StaleKV, block: torch.nn.Module, index: int) -> None:
        super().__init__()
        self.block = block
        self._emulation = [emulation]
        self._index = index
        self._signature = inspect.signature(block.forward)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        emulation = self._emulation[0]
        if not emulation.pipelined:
            # The text's length, for the attention to tell the streams apart (FLUX's
            # single-stream blocks get them concatenated).
            arguments = self._signature.bind_partial(*args, **kwargs).arguments
            text = arguments.get("encoder_hidden_states")
            joint = len(BLOCK_OUTPUTS[type(emulation.transformer).__name__]) == 2
            emulation.text_tokens = text.shape[1] if joint and text is not None else 0
            return self.block(*args, **kwargs)
        if self._index == 0:
            arguments = dict(self._signature.bind_partial(*args, **kwargs).arguments)
            emulation.payload = emulation.run_patches(arguments)
        return emulation.payload


class _Processor:
    """A layer's attention with its K/V buffer over the image."""

    def __init__(self, emulation: StaleKV, layer: int) -> None:
        self.emulation = emulation
        self.layer = layer

    def __call__(self, attn: Any, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: Any = None) -> Any:
        emulation = self.emulation
        ops = emulation.family.ops
        state = AttentionState(attn, hidden_states, encoder_hidden_states, attention_mask,
                               {"rotary_emb": image_rotary_emb,
                                "encoder_hidden_states_mask": None})
        for op in ("proj_q", "proj_k", "proj_v", "qk_norm", "rope"):
            getattr(ops, op)(state)
        q, k, v = (state.tensors[name] for name in ("q", "k", "v"))  # (B, L, H, D)
        text = emulation.text_tokens if "text" in ops.streams else 0
        sizes = {"text": text, "image": q.shape[1] - text}
        parts_k = dict(zip(ops.streams, k.split([sizes[s] for s in ops.streams], dim=1),
                           strict=True))
        parts_v = dict(zip(ops.streams, v.split([sizes[s] for s in ops.streams], dim=1),
                           strict=True))
        if emulation.patch is None:
            emulation.buffers[self.layer] = (parts_k["image"].clone(),
                                             parts_v["image"].clone())
        else:
            rows = patch_image_rows(emulation.image_tokens, emulation.ulysses,
                                    emulation.patches, emulation.patch)
            buffer_k, buffer_v = emulation.buffers[self.layer]
            buffer_k[:, rows] = parts_k["image"]
            buffer_v[:, rows] = parts_v["image"]
            parts_k["image"], parts_v["image"] = buffer_k, buffer_v
        keys = torch.cat([parts_k[s] for s in ops.streams], dim=1)
        values = torch.cat([parts_v[s] for s in ops.streams], dim=1)
        totals = tuple(keys.shape[1] - text if s == "image" else text for s in ops.streams)
        mask = ops.attention_mask(state, totals)
        state.tensors["out"] = dispatch_attention_fn(q, keys, values, attn_mask=mask)
        ops.proj_out(state)
        return state.result

"""What :func:`~cocodiff.runtime.parallel.parallelize` installs on an unmodified
diffusers transformer, all from the model's :class:`~cocodiff.runtime.families.Family`:
hooks that split the token streams where they enter the model and gather them where
they leave, and attention processors that run the plan's attention steps.
"""

from __future__ import annotations

import inspect
import time
from typing import TYPE_CHECKING, Any

import torch

from cocodiff.plan.executor import drive_blocking, run_steps
from cocodiff.runtime.exchange import all_gather_rows
from cocodiff.runtime.families.base import AttentionOps, AttentionState, Split, module_matches
from cocodiff.util.errors import CocodiffError

if TYPE_CHECKING:
    from cocodiff.runtime.parallel import UlyssesRuntime


class UnsupportedModelError(CocodiffError):
    """A model class the runtime has no family for."""


class UlyssesAttnProcessor:
    """Runs one layer's planned attention steps in place of a diffusers processor.

    The explicit parameters matter: diffusers passes a processor only the keyword
    arguments its ``__call__`` signature names. They are the union of what the supported
    attention modules pass: FLUX (``image_rotary_emb``) and Wan (``rotary_emb``) pass the
    rotary embedding positionally after ``attention_mask``, Qwen-Image passes
    ``image_rotary_emb`` and ``encoder_hidden_states_mask`` by keyword.
    """

    def __init__(self, runtime: UlyssesRuntime, ops: AttentionOps, layer_index: int) -> None:
        self.runtime = runtime
        self.ops = ops
        self.layer_index = layer_index

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Any = None,
        rotary_emb: Any = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
    ) -> Any:
        rotary = image_rotary_emb if image_rotary_emb is not None else rotary_emb
        extra = {"rotary_emb": rotary, "encoder_hidden_states_mask": encoder_hidden_states_mask}
        state = AttentionState(attn, hidden_states, encoder_hidden_states, attention_mask, extra)
        layer = self.runtime.layer_plan(
            self.layer_index, self.ops.streams, hidden_states.shape[0], hidden_states.dtype
        )
        backend = self.runtime.backend_type(self.runtime, self.ops, state, self.layer_index)
        drive_blocking(run_steps(layer.attention, backend))
        return state.result


def install_processors(runtime: UlyssesRuntime) -> None:
    ops = runtime.family.ops
    pattern = runtime.family.attention_modules
    layer_index = 0
    for name, module in runtime.transformer.named_modules():
        processor = getattr(module, "processor", None)
        if processor is None or type(processor).__name__ not in ops.processor_classes:
            continue
        if pattern is None or module_matches(name, pattern):
            module.set_processor(UlyssesAttnProcessor(runtime, ops, layer_index))
            layer_index += 1
    if layer_index != runtime.spec.num_layers:
        raise UnsupportedModelError(
            f"{type(runtime.transformer).__name__}: found {layer_index} attention processors "
            f"to replace, expected {runtime.spec.num_layers} (a custom processor installed, "
            f"or attention layers the runtime does not know?)"
        )


def install_splits(runtime: UlyssesRuntime) -> None:
    transformer = runtime.transformer
    transport = runtime.transport
    rank = runtime.sequence_index
    module_names = [name for name, _ in transformer.named_modules()]
    by_module: dict[str, list[Split]] = {}
    for split in runtime.family.splits:
        matched = [name for name in module_names if module_matches(name, split.module)]
        if not matched:
            raise UnsupportedModelError(
                f"{type(transformer).__name__} has no module {split.module!r} to split "
                f"{split.argument!r} at"
            )
        for name in matched:
            by_module.setdefault(name, []).append(split)

    def split_value(split: Split, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or split.ndim not in (None, value.ndim):
            return value
        shard = runtime.shard(split.stream, value.shape[split.dim])
        return shard.split(value, split.dim, rank)

    def input_hook(module, args, kwargs, splits):
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
        for split in splits:
            if split.argument in bound.arguments:
                bound.arguments[split.argument] = split_value(
                    split, bound.arguments[split.argument]
                )
        return bound.args, bound.kwargs

    def output_hook(module, args, output, splits):
        single = isinstance(output, torch.Tensor)
        values = [output] if single else list(output)
        for split in splits:
            values[split.argument] = split_value(split, values[split.argument])
        return values[0] if single else tuple(values)

    def root_hook(module, args, kwargs):
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
        runtime.begin_forward(bound.arguments.get("timestep"))
        return input_hook(module, args, kwargs, [s for s in by_module.get("", []) if not s.output])

    transformer.register_forward_pre_hook(root_hook, with_kwargs=True)
    for module_name, splits in by_module.items():
        module = transformer.get_submodule(module_name)
        inputs = [s for s in splits if not s.output]
        outputs = [s for s in splits if s.output]
        if module_name and inputs:
            module.register_forward_pre_hook(
                lambda m, a, k, s=inputs: input_hook(m, a, k, s), with_kwargs=True
            )
        if outputs:
            module.register_forward_hook(lambda m, a, o, s=outputs: output_hook(m, a, o, s))

    for gather in runtime.family.gathers:
        def gather_hook(module, args, output, gather=gather):
            shard = runtime.shards[gather.stream]
            start = time.perf_counter()
            chunks = all_gather_rows(transport, output.contiguous(), runtime.sequence_group)
            runtime.comm_s += time.perf_counter() - start
            runtime.count_gathered(runtime.sequence_group, output.numel() * output.element_size())
            # (P, ..., chunk, ...) -> (..., P*chunk, ...) -> drop the padding
            return shard.unsplit(torch.cat(list(chunks), dim=gather.dim), gather.dim)

        transformer.get_submodule(gather.module).register_forward_hook(gather_hook)

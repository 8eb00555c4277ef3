"""Numerics guards: a NaN or Inf in a denoising step stops the run with the step and layer,
instead of being written into an image.

The guard hooks (forward hooks, no model code changed):

* the output of every attention layer: under :func:`~cocodiff.runtime.parallel.parallelize`
  the layers it parallelised, numbered as the plan numbers them; single-process, every
  attention module, in module order;
* the transformer's output (the noise prediction the scheduler turns into the next latents).

Each check is one ``torch.isfinite(x).all()`` per tensor, kept on the device; the flags are
read once per step, in :meth:`NumericsGuard.end_step` (one host sync per step, not one per
layer), and the first non-finite one is reported. NaN spreads to every rank through the
exchanges and the final gather, so every rank stops at the same step instead of waiting for
a peer that stopped.
"""

from __future__ import annotations

from typing import Any

import torch

from cocodiff.runtime.hooks import UlyssesAttnProcessor


class NumericsError(RuntimeError):
    """Non-finite values appeared in a denoising step."""


class NumericsGuard:
    """Checks one pipeline's transformer for non-finite values, step by step.

    Args:
        rank: this process's global rank, for the message.
    """

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.step = 1  # the step in progress, counted from 1
        # (layer index or None for the transformer, what, 0-d bool tensor "all finite")
        self._flags: list[tuple[int | None, str, torch.Tensor]] = []
        self._hooks: list[Any] = []

    def install(self, transformer: torch.nn.Module) -> NumericsGuard:
        """Hook the attention layers and the output of ``transformer``; returns self."""
        modules = [(name, module) for name, module in transformer.named_modules()
                   if getattr(module, "processor", None) is not None]
        parallel = [m for _, m in modules if isinstance(m.processor, UlyssesAttnProcessor)]
        if parallel:
            layers = [(m.processor.layer_index, m) for m in parallel]
        else:
            layers = list(enumerate(m for _, m in modules))
        for index, module in layers:
            hook = self._hook(index, "attention output")
            self._hooks.append(module.register_forward_hook(hook))
        hook = self._hook(None, "transformer output")
        self._hooks.append(transformer.register_forward_hook(hook))
        return self

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _hook(self, layer: int | None, what: str):
        def check(module: torch.nn.Module, args: Any, output: Any) -> None:
            for tensor in _tensors(output):
                self._flags.append((layer, what, torch.isfinite(tensor).all()))

        return check

    def end_step(self) -> None:
        """Check what the step computed; call after each denoising step.

        Raises:
            NumericsError: naming the step, the first layer with non-finite values and the
                rank.
        """
        flags, self._flags = self._flags, []
        if flags and not bool(torch.stack([flag for _, _, flag in flags]).all()):
            layer, what, _ = next(f for f in flags if not bool(f[2]))
            where = f"layer {layer} ({what})" if layer is not None else what
            raise NumericsError(
                f"non-finite values at step {self.step}, {where} on rank {self.rank}"
            )
        self.step += 1

    def check_latents(self, latents: torch.Tensor) -> None:
        """Check the final latents before anything is decoded or written.

        Raises:
            NumericsError: they hold NaN or Inf.
        """
        self.end_step()  # flags of a last step that ran without a callback
        if not bool(torch.isfinite(latents).all()):
            raise NumericsError(f"non-finite values in the final latents on rank {self.rank}")


def _tensors(output: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a module output (a tensor, a tuple, or a diffusers
    output object holding ``sample``)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    sample = getattr(output, "sample", None)
    return _tensors(sample) if sample is not None else []

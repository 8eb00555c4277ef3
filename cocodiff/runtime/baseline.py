"""Baselines: other systems' sequence parallelism on the same model, weights and inputs,
so that ``cocodiff run`` measures them side by side with our own schedules.

``diffusers``: diffusers' built-in Ulysses context parallelism
(``ContextParallelConfig(ulysses_degree=P)``, ``transformer.enable_parallelism``). It
splits the token streams where they enter the transformer (its ``_cp_plan``), runs Q's,
K's and V's all-to-alls one after another, each waited before the next starts, then
the output's, over torch.distributed; it knows nothing of the topology and overlaps
nothing. It is enabled exactly as a diffusers user would, with one accommodation for CPU
runs: diffusers picks a device as ``rank % torch.accelerator.device_count()``, which is
0 on a CPU-only machine, so the count reads 1 while the parallelism is set up.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from unittest import mock

from cocodiff.util.errors import CocodiffError
from transports.base import Transport

if TYPE_CHECKING:
    import torch

# Importing this module costs no torch: run's argument checks read BASELINES first.
DIFFUSERS = "diffusers"


@dataclass(slots=True)
class BaselineRuntime:
    """What ``cocodiff run`` reads back from a parallelised model.

    Attributes:
        schedule: the baseline's name.
        comm_s: seconds spent waiting for communication; None: the baseline does not
            expose its collectives, so this is not measured.
    """

    schedule: str
    comm_s: float | None = None


def _cp_inputs(transformer: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """The model plan's named inputs, by module (no wildcard): module -> argument -> spec.
    Positional entries (a module's outputs that are split) are left out."""
    plan = getattr(transformer, "_cp_plan", None) or {}
    return {
        module: {name: spec for name, spec in entry.items() if isinstance(name, str)}
        for module, entry in plan.items()
        if isinstance(entry, dict) and "*" not in module
    }


def enable_diffusers_ulysses(model: Any, transport: Transport) -> BaselineRuntime:
    """Make a diffusers pipeline (or its transformer) run with diffusers' own Ulysses
    context parallelism over every rank of ``transport``'s job.

    Every rank calls this, then runs the pipeline as usual with the same inputs.

    Args:
        model: a diffusers pipeline or transformer.
        transport: a torch transport over the whole job (its default process group is
            the one diffusers uses).

    Raises:
        CocodiffError: the transport is not torch.distributed, the model class has no
            context-parallel plan in diffusers, or its heads do not split evenly.
    """
    import torch
    from diffusers import ContextParallelConfig

    transformer = getattr(model, "transformer", model)
    world_size = transport.world_size
    if transport.name != "torch":
        raise CocodiffError(
            f"--schedule {DIFFUSERS} runs diffusers' own context parallelism, which works over "
            f"torch.distributed only: use --transport torch (got {transport.name})"
        )
    class_name = type(transformer).__name__
    if not getattr(transformer, "_cp_plan", None):
        raise CocodiffError(
            f"diffusers has no context-parallel plan for {class_name}, so --schedule "
            f"{DIFFUSERS} cannot run it (diffusers {_diffusers_version()} has one for the "
            f"families {', '.join(_families_with_cp_plan())})"
        )
    heads = int(transformer.config.num_attention_heads)
    if heads % world_size:
        raise CocodiffError(
            f"diffusers' Ulysses splits the {heads} heads of {class_name} evenly over the "
            f"ranks: {world_size} ranks do not divide them (cocodiff's schedules split unevenly)"
        )
    for module_name, inputs in _cp_inputs(transformer).items():
        if inputs:
            transformer.get_submodule(module_name).register_forward_pre_hook(
                _even_split_check(inputs, world_size), with_kwargs=True)
    # Only a deprecation notice of torch's functional collectives, once per rank and call site.
    warnings.filterwarnings("ignore", category=FutureWarning,
                            module=r"diffusers\.hooks\.context_parallel")
    no_accelerator = torch.accelerator.device_count() == 0
    patch = (mock.patch.object(torch.accelerator, "device_count", return_value=1)
             if no_accelerator else nullcontext())
    with patch:
        transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world_size))
    return BaselineRuntime(DIFFUSERS)


def _even_split_check(inputs: dict[str, Any], world_size: int) -> Callable[..., None]:
    """A forward pre-hook that refuses, in one line, a token stream diffusers would split
    unevenly (it splits without padding and would fail deep inside with a shape error)."""
    import torch

    def check(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
        for argument, spec in inputs.items():
            value = bound.get(argument)
            if not isinstance(value, torch.Tensor) or value.dim() != spec.expected_dims:
                continue
            tokens = value.shape[spec.split_dim]
            if tokens % world_size:
                raise CocodiffError(
                    f"diffusers' context parallelism splits {argument} ({tokens} tokens) evenly "
                    f"over the ranks, and {world_size} ranks do not divide {tokens}; pick a "
                    "resolution or rank count that does (cocodiff's schedules pad)"
                )

    return check


def _families_with_cp_plan() -> list[str]:
    from cocodiff.models import FAMILIES

    return [f.name for f in FAMILIES.values() if f.diffusers_context_parallel]


def _diffusers_version() -> str:
    import diffusers

    return diffusers.__version__


# Baseline name -> how it parallelises a model over a transport.
BASELINES: dict[str, Callable[[Any, Transport], BaselineRuntime]] = {
    DIFFUSERS: enable_diffusers_ulysses,
}

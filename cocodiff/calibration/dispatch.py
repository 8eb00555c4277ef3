"""What eager PyTorch dispatches, counted: the ATen ops (views, chunks, casts and copies
included) a call issues, seen by a ``TorchDispatchMode``; and the host's cost per op as
model code issues them (:func:`host_op_seconds`).

Why: eager blocks are bound by the host that issues their ops, not by their kernels
(docs/compute-model.md, "eager host"): diffusers' FLUX blocks dispatch 114 / 68 ATen ops
(151 / 101 under this project's runtime) where they launch ~40 kernels, and every op
costs the host its Python, module call and dispatch. The counts say how many; the
microbenchmark says how much each costs, at sizes where the kernels cost nothing. It is
a small stack of ``nn.Module`` calls written the way diffusers' blocks write theirs
(modules called through ``__call__``, ``chunk``, ``view`` / ``transpose`` / ``reshape``,
modulation, SDPA, gated residuals), not a copy of any block, and never timed against one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

# The microbenchmark's sizes: small enough that the kernels cost nothing beside the host.
HOST_STACK_TOKENS = 4
HOST_STACK_WIDTH = 8
HOST_STACK_HEADS = 2


def count_ops(call: Callable[[], object]) -> int:
    """ATen ops one ``call()`` dispatches (after a warm-up call: first calls build caches)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    count = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            count[0] += 1
            return func(*args, **(kwargs or {}))

    call()
    with Count():
        call()
    return count[0]


def ops_per_block(blocks: dict[str, list[Any]], forward: Callable[[], object]
                  ) -> dict[str, float]:
    """ATen ops one ``forward()`` dispatches inside each kind of block, per block call:
    ``blocks`` maps a kind's name to its modules (e.g. FLUX's ``transformer_blocks`` and
    ``single_transformer_blocks``). Only ops issued between a block's forward pre-hook
    and its forward hook count."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    current: list[str | None] = [None]
    counts: Counter[str] = Counter()
    calls: Counter[str] = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if current[0] is not None:
                counts[current[0]] += 1
            return func(*args, **(kwargs or {}))

    def enter(kind: str) -> Callable[..., None]:
        def hook(*_: object) -> None:
            current[0] = kind
            calls[kind] += 1
        return hook

    handles = []
    for kind, modules in blocks.items():
        for module in modules:
            handles.append(module.register_forward_pre_hook(enter(kind)))
            handles.append(module.register_forward_hook(lambda *_: current.__setitem__(0, None)))
    try:
        with torch.inference_mode():
            forward()  # warm up (the hooks count its calls: forget them)
            calls.clear()
            with Count():
                forward()
    finally:
        for handle in handles:
            handle.remove()
    return {kind: counts[kind] / calls[kind] for kind in calls}


def runtime_ops_per_block(config: dict, streams, world: int, dtype: str = "float32",
                          device: Any = "cpu") -> tuple[dict[str, float], dict[str, int]]:
    """``(ops per block call, blocks)`` by block list (``transformer_blocks``, ...) of a
    fresh transformer of ``config`` run as a rank of ``world`` Ulysses ranks runs it (the
    runtime's processors over a stand-in transport): :func:`ops_per_block`."""
    from cocodiff.calibration.blocks import block_timing, build_transformer, standin_forward

    transformer = build_transformer(config)
    forward, _standin = standin_forward(transformer, streams, world, 0, dtype, device)
    lists = {attr: list(getattr(transformer, attr))
             for attr in block_timing(type(transformer).__name__)[1]}
    return ops_per_block(lists, forward), {attr: len(blocks) for attr, blocks in lists.items()}


def runtime_ops_per_layer(config: dict, streams, world: int, dtype: str = "float32",
                          device: Any = "cpu") -> float:
    """ATen ops per layer (the mean over the model's own blocks) under the runtime."""
    per_block, sizes = runtime_ops_per_block(config, streams, world, dtype, device)
    return (sum(per_block.get(attr, 0.0) * n for attr, n in sizes.items())
            / sum(sizes.values()))


def host_stack(dtype: Any, device: Any):
    """``(module, inputs)``: the microbenchmark's stack of module calls (module docstring)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    d, heads = HOST_STACK_WIDTH, HOST_STACK_HEADS

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.modulation = nn.Linear(d, 3 * d)
            self.norm = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
            self.to_q, self.to_k, self.to_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
            self.norm_q = nn.RMSNorm(d // heads, eps=1e-6)
            self.norm_k = nn.RMSNorm(d // heads, eps=1e-6)
            self.to_out = nn.Linear(d, d)
            self.act = nn.GELU(approximate="tanh")
            self.ff_in, self.ff_out = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

        def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
            shift, scale, gate = self.modulation(F.silu(emb)).chunk(3, dim=-1)
            h = self.norm(x) * (1 + scale[:, None]) + shift[:, None]
            b, s, _ = h.shape
            q = self.norm_q(self.to_q(h).view(b, s, heads, -1)).transpose(1, 2)
            k = self.norm_k(self.to_k(h).view(b, s, heads, -1)).transpose(1, 2)
            v = self.to_v(h).view(b, s, heads, -1).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1)
            x = x + gate[:, None] * self.to_out(o)
            return x + self.ff_out(self.act(self.ff_in(x)))

    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        stack = Stack().to(device=device, dtype=dtype).eval()
    x = torch.randn(1, HOST_STACK_TOKENS, d, generator=gen).to(device, dtype)
    emb = torch.randn(1, d, generator=gen).to(device, dtype)
    return stack, (x, emb)

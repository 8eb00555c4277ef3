"""V-Major: send only the active V blocks over slow tiers.

Adjacent denoising steps produce similar V. On the slow (inter-node) tier a sender
sends only the fraction of its V blocks that changed most since the last step the
receiver holds (largest L1 change); the receiver reuses its cached copy for the rest.
The cached fraction follows a schedule over the denoising steps: the paper ramps it
linearly from 0 to 1; warm-up steps and periodic refreshes send everything. This is
lossy: the runtime reports PSNR/SSIM against the exact output beside the speed.

Blocks, and what a partial message weighs, are plan data (:mod:`cocodiff.plan.vblocks`):
the plan's phases carry them, the simulator charges them and the runtime sends them.
"""

from __future__ import annotations

from dataclasses import dataclass

from cocodiff.util.errors import ScheduleError

RATIO_SCHEDULES = ("linear", "constant")
# V-Major's cache ratios are planned at this resolution (5 distinct plans at most).
RATIO_RESOLUTION = 1 / 4


@dataclass(frozen=True, slots=True)
class VMajorOptions:
    """How much of V is cached, step by step.

    Args:
        schedule: "linear" (cached fraction ramps from 0 after the warm-up to
            ``max_ratio`` at the last step) or "constant" (``max_ratio`` after warm-up).
        max_ratio: the largest cached fraction, in [0, 1].
        warmup: first steps that send everything (the cache needs a full V first).
        refresh: every ``refresh``-th step sends everything (0: never).
        slow_levels: tiers on which V-Major applies.
    """

    schedule: str = "linear"
    max_ratio: float = 1.0
    warmup: int = 1
    refresh: int = 0
    slow_levels: tuple[str, ...] = ("node",)

    def __post_init__(self) -> None:
        if self.schedule not in RATIO_SCHEDULES:
            raise ScheduleError(f"unknown V-Major ratio schedule {self.schedule!r}; valid: "
                                f"{', '.join(RATIO_SCHEDULES)}")
        if not 0.0 <= self.max_ratio <= 1.0:
            raise ScheduleError(f"V-Major ratio {self.max_ratio} is outside [0, 1]")
        if self.warmup < 0 or self.refresh < 0:
            raise ScheduleError(f"V-Major warm-up {self.warmup} and refresh {self.refresh} "
                                "must be >= 0")

    @staticmethod
    def parse(text: str, warmup: int = 1, refresh: int = 0) -> VMajorOptions:
        """From "linear", "linear:0.8" or "constant:0.5"."""
        name, _, ratio = text.partition(":")
        try:
            max_ratio = float(ratio) if ratio else 1.0
        except ValueError:
            raise ScheduleError(f"V-Major ratio {ratio!r} is not a number") from None
        return VMajorOptions(name, max_ratio, warmup, refresh)

    def cache_ratio(self, step: int, num_steps: int) -> float:
        """The fraction of V blocks reused from cache at ``step`` (0-based)."""
        if step < self.warmup or (self.refresh and step % self.refresh == 0):
            return 0.0
        if self.schedule == "constant":
            return self.max_ratio
        ramp_steps = max(1, num_steps - 1 - self.warmup)
        return self.max_ratio * min(1.0, (step - self.warmup + 1) / ramp_steps)

    def planned_ratio(self, step: int, num_steps: int) -> float:
        """The cached fraction a plan uses at ``step``: :meth:`cache_ratio` rounded to a
        multiple of :data:`RATIO_RESOLUTION`, so that a generation has a few distinct
        plans (the simulator runs each once; the runtime creates its groups once)."""
        ratio = self.cache_ratio(step, num_steps)
        return round(ratio / RATIO_RESOLUTION) * RATIO_RESOLUTION

"""The options every schedule takes, as one keyword-only object.

A scheduler is ``plan(spec, grid, stream_tokens, options)``: the model, where the ranks
sit and the token streams say *what* is run; :class:`PlanOptions` says *how*. The same
object travels in a plan file (:mod:`cocodiff.schedules.run_plan`), so what was simulated is what
runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cocodiff.schedules.tapa import DEFAULT_CHUNKS
from cocodiff.schedules.vmajor import VMajorOptions
from cocodiff.util.errors import ScheduleError

# Bytes per activation value, by the torch dtype's name (float64: the runtime's exactness
# tests; bfloat16: what the simulator charges by default, as the paper's runs use).
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_DTYPE = "bfloat16"


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanOptions:
    """How a schedule carries a step.

    Args:
        dtype: activation dtype (a :data:`DTYPE_BYTES` name); sets every exchange's bytes.
        batch: samples per transformer call (2: a classifier-free-guidance batch).
        chunks: pieces a phased exchange's rows are cut into and pipelined through the
            phases (phased schedules only; flat ignores it).
        vmajor: V-Major's ratio schedule (step-dependent schedules only); None runs
            them exactly (no selective phase).
    """

    dtype: str = DEFAULT_DTYPE
    batch: int = 1
    chunks: int = DEFAULT_CHUNKS
    vmajor: VMajorOptions | None = field(default_factory=VMajorOptions)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ScheduleError(f"unknown dtype {self.dtype!r}; valid: {', '.join(DTYPE_BYTES)}")
        for name in ("batch", "chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ScheduleError(f"{name} must be a positive integer, got {value!r}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


DEFAULT_OPTIONS = PlanOptions()

"""Running the suite on two workers (``pytest -n 2``, as README.md and .ci/run give it).

Real multi-rank jobs (``multiprocess``), the emulated cluster's namespaces and anything
that starts a launcher stay on one worker, one at a time, as in a serial run: torchrun's
default port, the namespaces' names and a job's ranks would collide or starve each other.
Every other test (simulator, plan, in-process runtime) fills the second core meanwhile.
Without xdist (plain ``pytest``) the group marks are inert."""

from __future__ import annotations

from pathlib import Path

import pytest

# Files whose tests start launchers or shape namespaces, marked or not.
_SERIAL_DIRS = ("emulated",)


def _starts_jobs(path: Path) -> bool:
    text = path.read_text(encoding="utf-8", errors="replace")
    return any(word in text for word in ("launcher_prefix", "MPIEXEC", "TORCHRUN"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seen: dict[Path, bool] = {}
    for item in items:
        path = Path(item.path)
        if path not in seen:
            seen[path] = path.parent.name in _SERIAL_DIRS or _starts_jobs(path)
        if seen[path] or item.get_closest_marker("multiprocess"):
            item.add_marker(pytest.mark.xdist_group("jobs"))

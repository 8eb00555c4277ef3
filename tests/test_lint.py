"""The linters the project configures (pyproject.toml), run inside the test suite so that
CI, which runs exactly the README's test command, runs them too.

ruff checks the whole repository. mypy checks the modules that are clean today
(``TYPED``); the rest (``UNTYPED``, about 50 errors) is listed here so that the list
shrinks as modules are fixed, and a module moved or added lands in one of the two.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from launching import REPO

BIN = Path(sys.executable).parent

TYPED = (
    "topology", "sim", "transports",
    "cocodiff/__init__.py", "cocodiff/__main__.py", "cocodiff/cost.py", "cocodiff/kernels.py",
    "cocodiff/memory.py", "cocodiff/quality.py",
    "cocodiff/models",
    "cocodiff/commands", "cocodiff/plan", "cocodiff/simulator", "cocodiff/util",
    "cocodiff/runtime/__init__.py", "cocodiff/runtime/backend.py",
    "cocodiff/runtime/baseline.py", "cocodiff/runtime/digits.py",
    "cocodiff/runtime/digits_train.py", "cocodiff/runtime/doctor.py",
    "cocodiff/runtime/exchange.py", "cocodiff/runtime/failures.py",
    "cocodiff/runtime/faults.py", "cocodiff/runtime/guards.py", "cocodiff/runtime/hooks.py",
    "cocodiff/runtime/job.py", "cocodiff/runtime/model_names.py", "cocodiff/runtime/nodes.py",
    "cocodiff/runtime/parallel.py", "cocodiff/runtime/pipefusion.py",
    "cocodiff/runtime/quiet.py", "cocodiff/runtime/sharding.py", "cocodiff/runtime/tapa.py",
    "cocodiff/runtime/vmajor.py", "cocodiff/schedules/__init__.py",
    "cocodiff/schedules/gather.py", "cocodiff/schedules/hybrid.py",
    "cocodiff/schedules/options.py", "cocodiff/schedules/pipefusion.py",
    "cocodiff/schedules/run_plan.py",
    "cocodiff/schedules/registry.py", "cocodiff/schedules/ulysses.py",
    "cocodiff/schedules/vmajor.py",
)
# Not yet clean under mypy (errors in the module itself).
UNTYPED = (
    "cocodiff/calibration", "cocodiff/layout.py", "cocodiff/validation.py",
    "cocodiff/runtime/families", "cocodiff/runtime/hybrid.py",
    "cocodiff/runtime/pipelines.py", "cocodiff/runtime/tiny",
    "cocodiff/schedules/activity.py", "cocodiff/schedules/flat.py",
    "cocodiff/schedules/grid.py", "cocodiff/schedules/tapa.py",
)
# The project's mypy settings, plus: the big third-party packages are not analysed (their
# names are Any). Reading torch's and diffusers' sources costs minutes of CPU per cold run;
# our own code's types are what this test is for.
MYPY_CONFIG = """\
[mypy]
python_version = 3.11
ignore_missing_imports = True
follow_imports = silent

[mypy-torch.*,diffusers.*,transformers.*,safetensors.*,accelerate.*,networkx.*,simpy.*,\
rich.*,matplotlib.*,mpi4py.*,PIL.*,sklearn.*,skimage.*,scipy.*]
follow_imports = skip
"""


def _tool(name: str) -> str:
    found = BIN / name
    if found.exists():
        return str(found)
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]')")
    return path


def test_ruff_passes_on_the_whole_repository():
    done = subprocess.run([_tool("ruff"), "check", "--output-format", "concise", "."],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_module_is_listed_typed_or_untyped():
    listed = [REPO / path for path in (*TYPED, *UNTYPED)]
    modules = [path for package in ("topology", "sim", "transports", "cocodiff")
               for path in (REPO / package).rglob("*.py")]
    unlisted = [str(path.relative_to(REPO)) for path in modules
                if not any(path == entry or entry in path.parents for entry in listed)]
    assert unlisted == []


def test_mypy_passes_on_the_typed_modules(tmp_path):
    config = tmp_path / "mypy.ini"
    config.write_text(MYPY_CONFIG)
    done = subprocess.run(
        [_tool("mypy"), "--config-file", str(config), "--cache-dir", str(tmp_path / "cache"),
         *TYPED], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr

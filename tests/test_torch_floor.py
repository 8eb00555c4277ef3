"""pyproject's torch range keeps the torch a machine already has: pip's resolver, run dry in
a throwaway environment whose only packages are stand-ins (metadata alone) at the versions
constraints.txt pins, and torch at the version under test. No index, no download.

Aurora's ``frameworks`` module ships an XPU torch ``2.10.0a0+git449b176`` (ALCF, "PyTorch on
Aurora", https://docs.alcf.anl.gov/aurora/data-science/frameworks/pytorch/); ALCF's recipe is
a venv with ``--system-site-packages`` over it (https://docs.alcf.anl.gov/aurora/data-science/
python/), which the ``.pth`` file below stands in for."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
AURORA_TORCH = "2.10.0a0+git449b176"


def _requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip()


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[name.strip().lower().replace("_", "-")] = version.split(";")[0].strip()
    return pins


def _stand_in(site: Path, name: str, version: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    info.joinpath("METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    info.joinpath("RECORD").write_text("")


def _dry_run(tmp_path: Path, torch_version: str) -> subprocess.CompletedProcess:
    """``pip install --dry-run`` of pyproject's dependencies into an environment that
    already holds them (torch at ``torch_version``)."""
    requirements = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = requirements["dependencies"]
    pins = _pins()
    module_site = tmp_path / "module-site"  # the frameworks module's packages, read-only
    for requirement in requirements:
        name = _requirement_name(requirement).lower()
        if "python_version <" in requirement:
            continue
        _stand_in(module_site, name, torch_version if name == "torch" else pins[name])
    environment = tmp_path / "venv"
    venv.create(environment, with_pip=False)
    site_packages = next(environment.glob("lib/python3*/site-packages"))
    site_packages.joinpath("frameworks-module.pth").write_text(f"{module_site}\n")
    # No configuration, no index, no find-links: only what is installed may satisfy.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    report = tmp_path / "report.json"
    job = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(environment / "bin" / "python"),
         "install", "--dry-run", "--no-index", "--disable-pip-version-check", "--quiet",
         "--report", str(report), *requirements],
        env=env, capture_output=True, text=True, timeout=240)
    job.report = json.loads(report.read_text()) if report.exists() else None  # type: ignore
    return job


@pytest.mark.parametrize("torch_version", [AURORA_TORCH, "2.8.0"])
def test_install_keeps_the_torch_already_there(tmp_path, torch_version):
    job = _dry_run(tmp_path, torch_version)
    assert job.returncode == 0, job.stderr
    assert job.report["install"] == []  # nothing to add or replace: torch stays


def test_a_torch_below_the_floor_is_not_enough(tmp_path):
    # 2.7 has no xccl: pip must look for another torch (here: none to be had, no index).
    job = _dry_run(tmp_path, "2.7.1")
    assert job.returncode != 0
    assert re.search(r"torch>=2\.8\b", job.stderr), job.stderr

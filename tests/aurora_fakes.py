"""Stand-ins for what only Aurora has, so CI can prove the launch logic without the machine:
PALS' and PBS' variables, a ``torch.xpu`` that sees twelve tiles (FLAT mode) or the one tile
a per-rank ``ZE_AFFINITY_MASK`` leaves, and an mpi4py that is missing or sees some number
of ranks.

Facts they copy (public sources):
* PALS exports ``PALS_RANKID``, ``PALS_LOCAL_RANKID``, ``PALS_LOCAL_SIZE``, ``PALS_NODEID``,
  ``PALS_PMI=pmix`` and no global size (argonne-lcf/DLcomm_benchmark, docs/fixes/23).
* The ``frameworks`` module's torch reports ``2.10.0a0+git449b176`` and, per tile,
  ``_XpuDeviceProperties(..., uuid=d20ebf0c-4ca0-6be7-0000-000000000001, ...)``; FLAT mode
  shows 12 devices, a mask leaves one (https://docs.alcf.anl.gov/aurora/data-science/
  frameworks/pytorch/).
* ``gpu_tile_compact.sh`` sets ``ZE_AFFINITY_MASK=<gpu>.<tile>`` from the local rank
  (https://docs.alcf.anl.gov/aurora/running-jobs-aurora/).
"""

from __future__ import annotations

import importlib.machinery
import sys
import textwrap
import types
from pathlib import Path

AURORA_TORCH = "2.10.0a0+git449b176"
TILES_PER_NODE = 12
TILES_PER_GPU = 2


def tile_uuid(node: int, gpu: int, tile: int) -> str:
    """A UUID per tile: the same tile, the same UUID; any two tiles differ."""
    return f"d20ebf0c-4ca0-{node:04x}-{gpu:04x}-{tile + 1:012x}"


def pals_env(rank: int, ranks_per_node: int, *, pbs: bool = True) -> dict[str, str]:
    """What PALS' mpiexec exports to ``rank`` (no global size)."""
    env = {"PALS_RANKID": str(rank), "PALS_LOCAL_RANKID": str(rank % ranks_per_node),
           "PALS_LOCAL_SIZE": str(ranks_per_node), "PALS_NODEID": str(rank // ranks_per_node),
           "PALS_APID": "1234.0", "PALS_DEPTH": "4", "PALS_PMI": "pmix",
           "PMIX_RANK": str(rank)}
    if pbs:
        env["PBS_JOBID"] = "1234.aurora-pbs-0001.hostmgmt.cm.aurora.alcf.anl.gov"
    return env


class FakeXpu:
    """``torch.xpu`` as a rank sees it: ``visible`` tiles, given by (gpu, tile) pairs of
    ``node``; ``uuid=False`` for a runtime that reports no UUID."""

    def __init__(self, visible: list[tuple[int, int]], node: int = 0, uuid: bool = True):
        self._visible = visible
        self._node = node
        self._uuid = uuid
        self.current = 0

    def is_available(self) -> bool:
        return bool(self._visible)

    def device_count(self) -> int:
        return len(self._visible)

    def set_device(self, device) -> None:
        self.current = getattr(device, "index", device) or 0

    def current_device(self) -> int:
        return self.current

    def get_device_properties(self, index: int = 0):
        gpu, tile = self._visible[index]
        fields = {"name": "Intel(R) Data Center GPU Max 1550", "total_memory": 65520 << 20}
        if self._uuid:
            fields["uuid"] = tile_uuid(self._node, gpu, tile)
        return types.SimpleNamespace(**fields)


def flat_tiles() -> list[tuple[int, int]]:
    """FLAT mode: the node's 12 tiles in order, GPU-major."""
    return [(g, t) for g in range(TILES_PER_NODE // TILES_PER_GPU) for t in range(TILES_PER_GPU)]


def parse_mask(mask: str) -> list[tuple[int, int]]:
    """The tiles a ``ZE_AFFINITY_MASK`` of ``gpu.tile`` entries leaves visible."""
    tiles = []
    for entry in mask.split(","):
        gpu, _, tile = entry.partition(".")
        tiles.append((int(gpu), int(tile or 0)))
    return tiles


def fake_mpi_module(world_size: int, rank: int, ranks_per_node: int,
                    library: str = "MPICH Version: 4.1.2\nMPICH Release date: ...") -> tuple:
    """An ``mpi4py`` package and its ``MPI`` module for ``sys.modules``."""

    class Comm:
        def __init__(self, size: int, rank_: int):
            self._size, self._rank = size, rank_

        def Get_size(self) -> int:
            return self._size

        def Get_rank(self) -> int:
            return self._rank

        def Split_type(self, _kind):
            return Comm(min(ranks_per_node, world_size), rank % ranks_per_node)

        def Free(self) -> None:
            pass

    mpi = types.ModuleType("mpi4py.MPI")
    mpi.COMM_WORLD = Comm(world_size, rank)
    mpi.COMM_TYPE_SHARED = 1
    mpi.Get_library_version = lambda: library
    mpi.Is_initialized = lambda: True
    mpi.Is_finalized = lambda: False
    package = types.ModuleType("mpi4py")
    package.__spec__ = importlib.machinery.ModuleSpec("mpi4py", None, is_package=True)
    package.__file__ = "/opt/venv/lib/python3.11/site-packages/mpi4py/__init__.py"
    package.__path__ = []
    package.MPI = mpi
    return package, mpi


def write_site(directory: Path, *, xpu: str | None = None, mpi4py: str | None = None) -> Path:
    """A directory to put first on ``PYTHONPATH`` of a ``python -m cocodiff`` subprocess.

    Args:
        xpu: ``"none"``: torch is an XPU build that sees no XPU; ``"flat"``: it sees a
            node's 12 tiles (FLAT mode), each with its UUID; ``"mask"``: it sees the tiles
            ``ZE_AFFINITY_MASK`` leaves, the mask set from the local rank as
            ``gpu_tile_compact.sh`` does when the caller did not set one.
        mpi4py: ``"absent"``: mpi4py cannot be imported; ``"one-rank"``: an mpi4py that
            links the pip ``mpich`` wheel's MPICH and sees a world of one.
    """
    directory.mkdir(parents=True, exist_ok=True)
    lines = ["import sys"]
    if mpi4py == "absent":
        lines.append("sys.modules['mpi4py'] = None  # import fails, find_spec finds none")
    elif mpi4py == "one-rank":
        package = directory / "mpi4py"
        package.mkdir()
        package.joinpath("__init__.py").write_text("__version__ = '4.1.0'\n")
        package.joinpath("MPI.py").write_text(textwrap.dedent("""\
            COMM_TYPE_SHARED = 1
            class _Comm:
                def Get_size(self): return 1
                def Get_rank(self): return 0
                def Split_type(self, kind): return _Comm()
                def Free(self): pass
                def Abort(self, code): raise SystemExit(code)
            COMM_WORLD = _Comm()
            def Get_library_version():
                return "MPICH Version: 4.3.1\\nMPICH Release date: ..."
            def Is_initialized(): return True
            def Is_finalized(): return False
            """))
    if xpu == "flat":
        lines += [f"sys.path.insert(0, {str(Path(__file__).parent)!r})",
                  "import torch",
                  "from aurora_fakes import FakeXpu, flat_tiles",
                  "torch.xpu = FakeXpu(flat_tiles())",
                  "torch.version.xpu = '20250101'"]
    if xpu == "mask":
        lines += [f"sys.path.insert(0, {str(Path(__file__).parent)!r})",
                  "import os, torch",
                  "from aurora_fakes import FakeXpu, parse_mask",
                  "local = int(os.environ.get('MPI_LOCALRANKID', '0'))",
                  "os.environ.setdefault('ZE_AFFINITY_MASK', f'{local // 2}.{local % 2}')",
                  "torch.xpu = FakeXpu(parse_mask(os.environ['ZE_AFFINITY_MASK']))",
                  "torch.version.xpu = '20250101'"]
    if xpu == "none":
        lines += ["import torch",
                  f"torch.version.xpu = '20250101'  # an XPU build ({AURORA_TORCH}-like)",
                  "torch.xpu.is_available = lambda: False",
                  "torch.xpu.device_count = lambda: 0"]
    directory.joinpath("sitecustomize.py").write_text("\n".join(lines) + "\n")
    return directory


def install_fake_torch_xpu(monkeypatch, fake: FakeXpu) -> None:
    """Make this process's torch an XPU build whose ``torch.xpu`` is ``fake``."""
    import torch

    monkeypatch.setattr(torch, "xpu", fake)
    monkeypatch.setattr(torch.version, "xpu", "20250101", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def install_fake_mpi4py(monkeypatch, package, mpi) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", package)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)

"""The rooms stay as DESIGN.md draws them: imports flow ``topology <- sim <- transports <-
cocodiff``, command-line parsing lives in ``cocodiff.commands`` only, nothing but the
entry points imports the command layer, and no two modules import each other, directly
or around a loop.

Read from the source (ast), not by importing: a test that imports every module would
see only the imports that ran.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import networkx as nx
import pytest
from launching import REPO

PACKAGES = ("topology", "sim", "transports", "cocodiff")  # each may import only those before it
COMMANDS = "cocodiff.commands"
# The one module outside the command layer that may import it: ``python -m cocodiff``.
ENTRY_POINTS = {"cocodiff.__main__"}
# Modules outside the command layer that may parse flags: none.
ARGPARSE_ELSEWHERE: tuple[str, ...] = ()
# Imports inside functions (deferred: they run when called) that close a loop, with why
# they stay: none. A deferred import hides a loop from the module-level check, not from
# the reader.
DEFERRED_LOOPS: set[frozenset[str]] = set()


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


MODULES = _modules()


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _imported(tree: ast.AST, deferred: bool) -> list[str]:
    """Every dotted name ``tree`` imports; module level only unless ``deferred``. Names
    under ``if TYPE_CHECKING:`` are never imported at run time and do not count."""
    names: list[str] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import) and (top or deferred):
                names.extend(alias.name for alias in child.names)
            elif (isinstance(child, ast.ImportFrom) and (top or deferred)
                  and child.level == 0 and child.module):
                names.extend(f"{child.module}.{alias.name}" for alias in child.names)
            nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, top and not nested)

    visit(tree, True)
    return names


def _owner(name: str) -> str | None:
    """The module a dotted import name loads (``pkg.mod.Class`` -> ``pkg.mod``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


@cache
def _graph(deferred: bool) -> nx.DiGraph:
    """Module -> module it imports. A submodule's import also runs its packages'
    ``__init__``; those implied edges are left out (every package would loop with the
    modules its ``__init__`` re-exports)."""
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    for module, path in MODULES.items():
        for name in _imported(_tree(path), deferred):
            owner = _owner(name)
            if owner is not None and owner != module:
                graph.add_edge(module, owner)
    return graph


def test_the_module_list_is_the_package():
    assert {"cocodiff.commands.cli", "cocodiff.simulator.simulate", "cocodiff.plan.steps",
            "cocodiff.runtime.parallel", "topology", "transports.sim"} <= set(MODULES)


def test_no_module_level_import_cycle():
    assert list(nx.simple_cycles(_graph(deferred=False))) == []


def test_no_import_cycle_through_deferred_imports_but_the_listed_ones():
    loops = {frozenset(cycle) for cycle in nx.simple_cycles(_graph(deferred=True))}
    assert loops <= DEFERRED_LOOPS


@pytest.mark.parametrize("lower", range(len(PACKAGES)))
def test_imports_flow_one_way(lower):
    """topology imports none of sim, transports, cocodiff; sim none of the last two..."""
    above = PACKAGES[lower + 1:]
    upward = [(module, target) for module, target in _graph(deferred=True).edges
              if module.split(".")[0] == PACKAGES[lower] and target.split(".")[0] in above]
    assert upward == []


def test_only_the_command_layer_parses_arguments():
    parsing = [module for module, path in MODULES.items()
               if "argparse" in _imported(_tree(path), deferred=True)
               and not module.startswith(COMMANDS)
               and not module.startswith(ARGPARSE_ELSEWHERE)]
    assert parsing == []


def test_nothing_below_the_command_layer_imports_it():
    upward = [(module, target) for module, target in _graph(deferred=True).edges
              if target.startswith(COMMANDS) and not module.startswith(COMMANDS)
              and module not in ENTRY_POINTS]
    assert upward == []


# The engine's rooms, top to bottom: a room imports only the rooms below it (and itself).
ROOMS = ("cocodiff.commands", "cocodiff.validation", "cocodiff.calibration",
         "cocodiff.runtime", "cocodiff.simulator", "cocodiff.memory", "cocodiff.schedules",
         "cocodiff.plan", "cocodiff.cost", "cocodiff.kernels", "cocodiff.layout",
         "cocodiff.models", "cocodiff.quality", "cocodiff.util")


def _room(module: str) -> int | None:
    return next((i for i, room in enumerate(ROOMS)
                 if module == room or module.startswith(room + ".")), None)


def test_every_engine_module_is_in_a_room():
    outside = [module for module in MODULES if module.startswith("cocodiff.")
               and _room(module) is None and module not in ENTRY_POINTS]
    assert outside == []


def test_no_room_imports_one_above_it():
    upward = [(module, target) for module, target in _graph(deferred=True).edges
              if (low := _room(module)) is not None and (high := _room(target)) is not None
              and high < low]
    assert upward == []

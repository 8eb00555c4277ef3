"""Output files appear whole or not at all: write a temporary file beside the target,
then rename it over the target (atomic on POSIX)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from cocodiff.util.errors import CocodiffError
from cocodiff.util.paths import path_problem


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp_path)`` and move the result to ``path`` once it succeeded.

    Args:
        path: the final file.
        write: fills the temporary file (it keeps the target's suffix, so writers that
            pick a format from the suffix, like matplotlib or PIL, still do).
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"output directory {path.parent} does not exist")
    if path.is_dir():  # os.replace would fail after the work is done
        raise ValueError(f"output {str(path)!r} is a directory, not a file")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    def write(tmp: Path) -> None:
        tmp.write_text(text)

    atomic_write(path, write)


def check_output_paths(paths: Iterable[Path | None]) -> None:
    """Refuse, before any work, output paths that could not be written at the end.

    Raises:
        CocodiffError: a path the file system cannot hold (a name too long), a directory
            that does not exist, or a path that is a directory.
    """
    for path in paths:
        if path is None:
            continue
        problem = path_problem(path)
        if problem is not None:
            raise CocodiffError(f"output {_shown(path)} cannot be written: {problem}")
        if not path.parent.is_dir():
            raise CocodiffError(f"output directory {path.parent} does not exist (for {path})")
        if path.is_dir():  # also "" (the working directory)
            raise CocodiffError(f"output {str(path)!r} is a directory, not a file")


def check_output_directory(path: Path) -> None:
    """Refuse, before any work, a directory that a command would fill with files.

    It may exist (empty) or not; it is created at the end, with its missing parents.

    Raises:
        CocodiffError: a path the file system cannot hold, an existing file or non-empty
            directory, or a parent that is a file.
    """
    problem = path_problem(path)
    if problem is not None:
        raise CocodiffError(f"directory {_shown(path)} cannot be created: {problem}")
    if path.exists() and not path.is_dir():
        raise CocodiffError(f"{path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()):
        raise CocodiffError(f"{path} exists and is not empty")
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise CocodiffError(f"cannot create {path}: {parent} is not a directory")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise CocodiffError(f"cannot create {path}: {parent} is not writable")
            break


def _shown(path: Path) -> str:
    text = str(path)
    return repr(text) if len(text) <= 80 else f"{text[:60]!r}... ({len(text)} characters)"

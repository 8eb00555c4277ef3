"""Output files appear whole or not at all: write a temporary file beside the target,
then rename it over the target (atomic on POSIX)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from cocodiff.errors import CocodiffError


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
    atomic_write(path, lambda tmp: tmp.write_text(text))


def check_output_paths(paths: Iterable[Path | None]) -> None:
    """Refuse, before any work, output paths that could not be written at the end.

    Raises:
        CocodiffError: a directory that does not exist, or a path that is a directory.
    """
    for path in paths:
        if path is None:
            continue
        if not path.parent.is_dir():
            raise CocodiffError(f"output directory {path.parent} does not exist (for {path})")
        if path.is_dir():  # also "" (the working directory)
            raise CocodiffError(f"output {str(path)!r} is a directory, not a file")

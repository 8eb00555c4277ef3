"""Paths a user gives, checked against the file system's limits before they are used.

``Path.is_dir()`` and ``os.stat`` raise (rather than answer False) for a name longer
than the file system allows (ENAMETOOLONG, 255 bytes per name on most Linux file
systems), so such a path must be refused before any of them is asked about it.
"""

from __future__ import annotations

import os
from pathlib import Path

# POSIX minimums, used where the file system cannot be asked (no existing ancestor).
_DEFAULT_NAME_MAX = 255
_DEFAULT_PATH_MAX = 4096


def path_problem(path: str | os.PathLike[str]) -> str | None:
    """Why the file system would refuse ``path`` whatever is on disk, or None.

    Checks each name against ``NAME_MAX`` and the whole path against ``PATH_MAX`` (both
    in bytes, as the file system counts them) of the nearest existing ancestor's file
    system; also an empty path and a NUL byte.
    """
    text = os.fspath(path)
    if text == "":
        return "the path is empty"
    encoded = os.fsencode(text)
    if b"\0" in encoded:
        return "the path holds a NUL byte"
    name_max, path_max = _limits(Path(text))
    longest = max((os.fsencode(part) for part in Path(text).parts), key=len, default=b"")
    if len(longest) > name_max:
        shown = os.fsdecode(longest[:24]) + "..."
        return (f"a name in it ({shown!r}) is {len(longest)} bytes long; this file system "
                f"allows {name_max}")
    if len(encoded) >= path_max:
        return f"it is {len(encoded)} bytes long; this file system allows {path_max - 1}"
    return None


def _limits(path: Path) -> tuple[int, int]:
    """NAME_MAX and PATH_MAX of the file system holding ``path``'s nearest existing
    ancestor (asked with short paths only, so the question itself cannot fail)."""
    ancestor = path.absolute().parent
    for candidate in (ancestor, *ancestor.parents):
        try:
            if len(os.fsencode(str(candidate))) < _DEFAULT_PATH_MAX and candidate.is_dir():
                return (os.pathconf(candidate, "PC_NAME_MAX"),
                        os.pathconf(candidate, "PC_PATH_MAX"))
        except (OSError, ValueError):
            continue
    return _DEFAULT_NAME_MAX, _DEFAULT_PATH_MAX

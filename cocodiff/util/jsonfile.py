"""Reading the JSON files a user hands us (model configs, activity traces, tiny-model
markers), with a bound on how deeply they nest.

The standard library's parser recurses once per level of nesting, so a file of 100,000
``[`` ends in a RecursionError (a traceback) instead of a one-line refusal. No file we
read nests more than a few levels, so the depth is measured on the text first, without
recursion, and anything deeper than :data:`MAX_JSON_DEPTH` is refused.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from pathlib import Path

# Model configs nest 3 levels, activity traces 5: 64 leaves room for any real file.
MAX_JSON_DEPTH = 64

# A JSON string (brackets inside one do not nest anything).
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(r"[^\[\]{}]+")


def json_depth(text: str) -> int:
    """How deeply ``text`` nests arrays and objects (0 for a scalar), without recursion.

    Brackets inside strings do not count; in text that is not JSON (an unterminated
    string, unbalanced brackets) it is an upper bound of the depth a parser would reach.
    """
    brackets = _BRACKETS.sub("", _STRING.sub("", text))
    return max(accumulate(1 if char in "[{" else -1 for char in brackets), default=0)


def read_json(path: str | Path, what: str, error: type[Exception]) -> object:
    """The parsed content of the JSON file ``path``.

    Args:
        path: the file.
        what: what the file is, for messages ("model config", "activity trace").
        error: the exception class to raise (the caller's one-line user error).

    Raises:
        error: a missing or unreadable file, text that is not UTF-8, invalid JSON, or
            nesting deeper than :data:`MAX_JSON_DEPTH`; one line naming the file.
    """
    shown = repr(str(path))
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise error(f"{what} {shown} does not exist") from None
    except IsADirectoryError:
        raise error(f"{what} {shown} is a directory, not a file") from None
    except OSError as err:
        raise error(f"cannot read {what} {shown}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise error(f"{what} {shown} is not UTF-8 text (byte {err.start}: "
                    f"{err.reason})") from None
    return parse_json(text, f"{what} {shown}", error)


def parse_json(text: str, where: str, error: type[Exception]) -> object:
    """``json.loads(text)``, refusing deep nesting; messages start with ``where``."""
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise error(f"{where} nests {depth} levels deep; at most {MAX_JSON_DEPTH} are read")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"invalid JSON in {where}: {err.msg} (line {err.lineno})") from None
    except ValueError as err:  # an integer past Python's digit limit, for one
        raise error(f"invalid JSON in {where}: {err}") from None

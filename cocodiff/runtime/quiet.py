"""Keeping the libraries' chatter out of a command's output.

A user reads anything on stderr as a problem. transformers and diffusers warn as they load
about things that do not concern a CoCoDiff user (torchvision missing, deprecations inside
their own code, advisory notes); every command silences them unless ``--verbose`` is given,
and our own warnings and every error still come through.
"""

from __future__ import annotations

import os
import sys
import warnings

VERBOSE_ENV = "COCODIFF_VERBOSE"
_QUIETED_ENV = "COCODIFF_QUIETED"  # the library variables set here, not by the user
# Read by the libraries when they first configure their loggers: set before they are
# imported, they never print a warning, in this process or in any process it starts.
_LIBRARY_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "DIFFUSERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}
# Python warnings raised inside these packages are about their own internals.
THIRD_PARTY_MODULES = (
    r"(transformers|diffusers|huggingface_hub|accelerate|torch|safetensors)(\.|$)")


def verbose() -> bool:
    """Whether the command was asked to show the libraries' warnings (``--verbose``)."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def quiet_third_party(*, show: bool = False) -> None:
    """Silence third-party warnings for the rest of this command (``show``: keep them).

    Cheap: imports nothing. Called once per command, before any library is loaded; where
    one already is (a command run in-process twice), its logger is set directly too.
    """
    if show:
        os.environ[VERBOSE_ENV] = "1"  # for quiet_libraries, here and in started processes
        # Undo what a quiet command run earlier in this process set (never a user's own).
        for name in filter(None, os.environ.pop(_QUIETED_ENV, "").split(",")):
            os.environ.pop(name, None)
        return
    os.environ.pop(VERBOSE_ENV, None)
    ours = [name for name in _LIBRARY_ENV if name not in os.environ]
    for name in ours:
        os.environ[name] = _LIBRARY_ENV[name]
    if ours:
        os.environ[_QUIETED_ENV] = ",".join(ours)
    warnings.filterwarnings("ignore", module=THIRD_PARTY_MODULES)
    if "transformers" in sys.modules or "diffusers" in sys.modules:
        quiet_libraries()


def quiet_libraries() -> None:
    """Silence transformers' and diffusers' warnings and progress bars (not under
    ``--verbose``).

    Call it before importing diffusers pipelines: importing them already warns (about
    torchvision missing, deprecations), and a user error must stay one line on stderr.
    Errors still surface as exceptions.
    """
    if verbose():
        return
    import transformers
    from diffusers.utils import logging as diffusers_logging

    transformers.logging.set_verbosity_error()
    diffusers_logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    diffusers_logging.disable_progress_bar()

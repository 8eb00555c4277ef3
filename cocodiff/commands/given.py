"""Which options a command line gave, whatever their values.

``simulate --plan`` and ``run --plan`` refuse the flags a plan file fixes. Comparing a
flag's value with its default cannot tell ``--schedule flat`` from no ``--schedule``
(flat being the default), nor ``--vmajor-warmup 0`` from an unset one; so the parser
records every option it is given in ``args.given`` as it parses.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from cocodiff.util.errors import CocodiffError


class _Store(argparse.Action):
    """argparse's ``store``, also adding the option's dest to ``namespace.given``."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        _record(namespace, self.dest)


class _StoreTrue(argparse.Action):
    """argparse's ``store_true``, also adding the option's dest to ``namespace.given``."""

    def __init__(self, option_strings, dest, default=False, required=False, help=None):
        super().__init__(option_strings, dest, nargs=0, const=True, default=default,
                         required=required, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, True)
        _record(namespace, self.dest)


def _record(namespace: argparse.Namespace, dest: str) -> None:
    # A new frozenset each time: the default one is shared by every parse.
    namespace.given = namespace.given | {dest}


def record_given(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` set ``args.given``: the dests of the options the command line
    gave. Call it before adding the arguments (``store`` and ``store_true`` options
    added afterwards record themselves)."""
    parser.register("action", None, _Store)
    parser.register("action", "store", _Store)
    parser.register("action", "store_true", _StoreTrue)
    parser.set_defaults(given=frozenset())


def refuse_plan_fixed(args: argparse.Namespace, fixed: Iterable[str]) -> None:
    """Refuse, in one line naming them, the options of ``fixed`` (dests) that were given
    beside ``--plan``, at whatever value.

    Raises:
        CocodiffError: one or more of them was given.
    """
    given = [name for name in fixed if name in args.given]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise CocodiffError(f"--plan fixes {flags}: drop {'it' if len(given) == 1 else 'them'}"
                            " (or make another plan)")

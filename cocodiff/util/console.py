"""The console that commands print their tables and notes through."""

from __future__ import annotations

from rich.console import Console


def plain_console(width: int | None = None) -> Console:
    """A rich console that shows every string as it is.

    Tables and notes quote names the user chose (a topology file's ``name``, a model
    directory): rich would read ``[/]`` in them as markup (and raise MarkupError) and
    ``:smile:`` as an emoji code. Nothing we print uses markup, so it is off.
    """
    return Console(width=width, markup=False, emoji=False)

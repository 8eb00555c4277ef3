"""Every relative link and image in README.md, docs/*.md and the READMEs of bench/ and
results/ points at a file that exists (and, where it names an anchor, at a heading of
that file): the README is a user's entry point and sends its reader to docs/ for every
answer and to results/measured/ for its data, so a broken link loses a result."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The README, the docs, and the indexes of bench/ and results/ that the docs send readers to.
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *(path for path in (ROOT / "bench" / "README.md", ROOT / "bench" / "cluster" /
                                 "README.md", ROOT / "results" / "README.md") if path.is_file())]

FENCE = re.compile(r"^(```|~~~).*?^\1", flags=re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
HTML_COMMENT = re.compile(r"<!--.*?-->", flags=re.S)
# [text](target) and ![alt](target), with an optional "title"; [label]: target definitions
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
DEFINITION = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", flags=re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", flags=re.I)  # http:, https:, mailto:, ...


def prose(text: str) -> str:
    """The text a reader sees as Markdown: code blocks, code spans and comments removed."""
    return INLINE_CODE.sub("", FENCE.sub("", HTML_COMMENT.sub("", text)))


def links(path: Path) -> list[str]:
    text = prose(path.read_text(encoding="utf-8"))
    return INLINE_LINK.findall(text) + DEFINITION.findall(text)


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors for a file's headings: lower case, punctuation dropped, spaces to
    hyphens, a repeated heading numbered -1, -2, ..."""
    anchors: set[str] = set()
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def test_documents_exist() -> None:
    assert (ROOT / "README.md").is_file()
    assert len(DOCUMENTS) > 1, "docs/*.md holds the README's full logs"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(document: Path) -> None:
    broken = []
    for target in links(document):
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (document.parent / file_part).resolve() if file_part else document
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    assert not broken, f"{document.name}: " + "; ".join(broken)


def test_readme_shows_every_plot() -> None:
    """Each plot in docs/ is shown by the README or by the doc that holds its log."""
    shown = {
        (document.parent / target).resolve()
        for document in DOCUMENTS
        for target in links(document)
        if target.endswith(".png")
    }
    unshown = [p.name for p in sorted((ROOT / "docs").glob("*.png")) if p.resolve() not in shown]
    assert not unshown, f"plots no document shows: {unshown}"


def test_link_parser_finds_and_skips() -> None:
    """The checks above pass only if the parser sees links at all: a known sample."""
    sample = (
        'See [a](docs/a.md#x) and ![p](docs/p.png "t").\n'
        "`[not](code.md)`\n```\n[nor](fenced.md)\n```\n<!-- [nor](comment.md) -->\n"
        "[ref]: docs/b.md\n"
    )
    text = prose(sample)
    assert INLINE_LINK.findall(text) + DEFINITION.findall(text) == [
        "docs/a.md#x",
        "docs/p.png",
        "docs/b.md",
    ]

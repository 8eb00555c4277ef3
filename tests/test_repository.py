"""What a newcomer clones: docs for users within a size budget, raw measurements kept apart
in a small curated ``results/measured/``, and no path that exists only on the machine the
project was developed on.

The files checked are the repository's: tracked ones and new ones git would add (not the
ignored scratch output of bench/ scripts under ``results/``), as they are on disk."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024
# Pages and the plots they show; a few MB in all with the measurements the docs cite.
DOCS_BUDGET_BYTES = 1.5 * MIB
DOCS_AND_RESULTS_BUDGET_BYTES = 3 * MIB
VALIDATE_MAX_LINES = 300


def repository_files() -> list[Path]:
    """Tracked files and untracked ones git does not ignore, that exist on disk."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True).stdout.decode("utf-8", "surrogateescape")
    return [ROOT / name for name in sorted(set(listed.split("\0"))) if name
            and (ROOT / name).is_file() and not (ROOT / name).is_symlink()]


def _size_under(files: list[Path], *folders: str) -> tuple[int, list[tuple[int, str]]]:
    chosen = [p for p in files if p.relative_to(ROOT).parts[0] in folders]
    sizes = sorted(((p.stat().st_size, str(p.relative_to(ROOT))) for p in chosen), reverse=True)
    return sum(size for size, _ in sizes), sizes


def test_docs_and_results_fit_their_size_budget() -> None:
    files = repository_files()
    docs, docs_sizes = _size_under(files, "docs")
    both, both_sizes = _size_under(files, "docs", "results")
    assert docs_sizes, "docs/ has no files"
    assert docs <= DOCS_BUDGET_BYTES, (
        f"docs/ is {docs / MIB:.2f} MiB, over {DOCS_BUDGET_BYTES / MIB} MiB; largest: "
        f"{docs_sizes[:5]}")
    assert both <= DOCS_AND_RESULTS_BUDGET_BYTES, (
        f"docs/ + results/ are {both / MIB:.2f} MiB, over "
        f"{DOCS_AND_RESULTS_BUDGET_BYTES / MIB} MiB; largest: {both_sizes[:5]} (keep the "
        f"measurements a page cites; git keeps the rest)")


def test_docs_hold_pages_and_plots_and_results_hold_the_measurements() -> None:
    """Raw measurement files (JSON, logs, TOML) live in results/measured/, not in docs/;
    results/ holds nothing else the repository tracks but its README."""
    files = repository_files()
    raw = [str(p.relative_to(ROOT)) for p in files
           if p.relative_to(ROOT).parts[0] == "docs" and p.suffix not in (".md", ".png")]
    assert not raw, f"measurement files in docs/ (move them to results/measured/): {raw}"
    stray = [str(p.relative_to(ROOT)) for p in files
             if p.relative_to(ROOT).parts[0] == "results"
             and p.relative_to(ROOT).parts[1] not in ("measured", "README.md")]
    assert not stray, f"results/ tracks only README.md and measured/: {stray}"


def test_validate_page_leads_with_the_current_answer() -> None:
    text = (ROOT / "docs" / "validate.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) < VALIDATE_MAX_LINES, (
        f"docs/validate.md has {len(lines)} lines: history goes to docs/changelog.md")
    first_section = next(line for line in lines if line.startswith("## "))
    assert first_section.startswith("## The current answer"), first_section
    # The answer is a table of measured against predicted, before any other section.
    answer = text.split(first_section, 1)[1].split("\n## ", 1)[0]
    assert "| median \\|error\\|" in answer and "predicted" in answer


def machine_paths() -> list[str]:
    """Absolute paths that exist only where the project was developed or tested: the
    development machine's work and root directories, and this checkout's own location
    and home directory, wherever the test runs."""
    # Joined so that this file does not name them itself.
    fixed = ["/" + "work" + "/", "/" + "root" + "/"]
    local = [str(ROOT) + "/", str(Path.home()) + "/"]
    return sorted({path for path in fixed + local if path.count("/") > 2 or path in fixed})


def test_no_file_names_a_path_of_this_machine() -> None:
    pattern = re.compile("|".join(re.escape(path) for path in machine_paths()))
    found = []
    for path in repository_files():
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary: a plot, a checkpoint
            continue
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not found, ("absolute paths of a development machine (cite a public source or "
                       "a path relative to the repository):\n" + "\n".join(found[:20]))


def test_the_path_check_sees_a_machine_path() -> None:
    """The check above passes only if it can fail: a sample it must catch, and one it must
    let through."""
    pattern = re.compile("|".join(re.escape(path) for path in machine_paths()))
    assert pattern.search("copied from " + "/" + "work" + "/shared/notes.md")
    assert pattern.search(f"File \"{ROOT}/cocodiff/cli.py\"")
    assert not pattern.search("python bench/emulated_speedup.py --json results/x.json")
    assert not pattern.search("OUT=/tmp/out bash bench/gpu_checklist.sh")

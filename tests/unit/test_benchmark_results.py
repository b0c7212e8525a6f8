"""benchmarks/results holds one current result per question: a folder named by what it measures, with a README.md that
names the command that wrote it, and no per-session copies (earlier runs live in git, cited by commit). Every path
into it that the docs, the benchmarks' READMEs, the scripts or the tests name exists. Cheap: reads files only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SCRATCH = RESULTS / "tmp"
"""Where the scripts write by default; git-ignored, so not a committed result."""
FOLDERS = sorted(p for p in RESULTS.iterdir() if p.is_dir() and p != SCRATCH)

FULL_PATH = re.compile(r"(?<![\w/.$-])benchmarks/results/[\w./{},*<>-]*")
"""A path into the results as the docs and the scripts write it, from the repository root."""
SHORT_PATH = re.compile(r"(?<![\w/.$-])results/[\w./{},*<>-]*")
"""The same from benchmarks/ (benchmarks/README.md writes ``results/<folder>``)."""
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
COMMAND = re.compile(r"(?:python3?\s+benchmarks/\S+\.py|benchmarks/\S+\.sh|halfserve\s+loadtest)\b")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def sources() -> list[Path]:
    """What names paths into the results: the docs, every Markdown file under benchmarks/, the scripts, the tests."""
    found = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    found += [p for p in (ROOT / "benchmarks").rglob("*") if p.suffix in {".md", ".py", ".sh"}]
    found += [p for p in (ROOT / "tests").rglob("*.py") if p != Path(__file__).resolve()]
    return sorted(p for p in found if SCRATCH not in p.parents)


def expand(name: str) -> list[str]:
    """``a.{json,md}`` as ``a.json`` and ``a.md``."""
    brace = re.search(r"\{([^{}]*)\}", name)
    if not brace:
        return [name]
    return [n for alt in brace.group(1).split(",") for n in expand(name[: brace.start()] + alt + name[brace.end() :])]


def exists(path: Path) -> bool:
    """Whether ``path`` is in the tree, or is the prefix of a run's files (``x`` for ``x.json`` and ``x.md``), or a
    glob that matches something; a ``<placeholder>`` needs only what comes before it."""
    text = str(path)
    if "<" in text:
        return Path(text[: text.index("<")].rstrip("/")).exists()
    if "*" in text:
        return any(path.parent.glob(path.name))
    return path.exists() or any(path.parent.glob(path.name + ".*"))


def missing_paths(source: Path) -> list[str]:
    text = source.read_text()
    named = [(ROOT, m.group(0)) for m in FULL_PATH.finditer(text)]
    if source.is_relative_to(ROOT / "benchmarks"):
        named += [(ROOT / "benchmarks", m.group(0)) for m in SHORT_PATH.finditer(text)]
    if source.suffix == ".md":
        for target in LINK.findall(text):
            if not re.match(r"[a-z]+:", target) and "results" in (source.parent / target).resolve().parts:
                named.append((source.parent, target))
    missing = []
    for base, raw in named:
        for name in expand(raw.rstrip(".,")):
            path = (base / name).resolve()
            if path != SCRATCH and SCRATCH not in path.parents and not exists(base / name):
                missing.append(name)
    return sorted(set(missing))


def test_results_are_folders_each_answering_one_question() -> None:
    assert FOLDERS, "benchmarks/results has no result folders"
    stray = [rel(p) for p in RESULTS.iterdir() if p.is_file()]
    assert not stray, f"results belong in a folder named by what they measure, with its README.md: {stray}"


def test_no_session_copies() -> None:
    sessions = [rel(p) for p in RESULTS.rglob("session-*") if SCRATCH not in p.parents]
    assert not sessions, f"one current result per question; earlier runs live in git, cited by commit: {sessions}"


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_every_result_folder_names_its_command(folder: Path) -> None:
    readme = folder / "README.md"
    assert readme.is_file(), f"{rel(folder)} has no README.md (what it answers, its command, its hardware)"
    # A shell block whose command (continuation lines joined) runs a benchmark and writes into this folder.
    blocks = re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", readme.read_text(), re.S)
    commands = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    assert any(COMMAND.search(c) and f"benchmarks/results/{folder.name}" in c for c in commands), (
        f"{rel(readme)} shows no command that writes into benchmarks/results/{folder.name}"
    )


def test_every_results_path_named_exists() -> None:
    missing = {rel(source): names for source in sources() if (names := missing_paths(source))}
    assert not missing, f"not in the tree (renamed or deleted? cite an earlier run by commit): {missing}"

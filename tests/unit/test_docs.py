"""The README and docs/ against the code: what they name exists, the commands they show parse, and the import table
in docs/architecture.md is the imports as they are. Cheap: nothing runs but one ``halfserve --help``."""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from halfserve.cli import build_parser
from halfserve.serving import Interface

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "server"
"""The source root: the package ``halfserve`` is ``server/halfserve/``."""
PKG = SRC / "halfserve"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("server", "tests", "benchmarks", "scripts", "examples", "deploy", "docs", "model_store", ".ci")
PATH = re.compile(r"(?<![\w/.$-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./-]*)")
MODULE = re.compile(r"(?<![\w/.])halfserve(?:\.[A-Za-z_]\w*)+")
NOT_MODULES = {"halfserve.architectures", "halfserve.access"}
"""Dotted names that are not modules: an entry-point group and a logger."""
SHELLS = {"bash", "sh", "shell", "console"}
"""The languages of the blocks read as commands (a block without one shows output)."""


def doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def read(doc: Path) -> str:
    return doc.read_text()


@dataclass
class Block:
    language: str
    text: str


def code_blocks(text: str) -> Iterator[Block]:
    """The fenced code blocks of a Markdown text, with their language (empty when none is given)."""
    language: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        fence = re.match(r"^\s*```(\S*)", line)
        if fence and language is None:
            language, lines = fence.group(1), []
        elif fence:
            yield Block(language or "", "\n".join(lines) + "\n")
            language = None
        elif language is not None:
            lines.append(line)


def shell_commands(text: str) -> Iterator[list[str]]:
    """Each simple command of the shell blocks in ``text``, as words: continuations joined, comments dropped, split at
    ``&&``, ``||``, ``;``, ``|`` and ``&``, leading ``NAME=value`` assignments dropped."""
    for block in code_blocks(text):
        if block.language not in SHELLS:
            continue
        for line in block.text.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            try:
                words = list(lexer)
            except ValueError:  # not shell (an unbalanced quote in shown output)
                continue
            command: list[str] = []
            for word in [*words, ";"]:
                if word and set(word) <= set(";&|"):
                    while command and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", command[0]):
                        command.pop(0)
                    if command:
                        yield command
                    command = []
                else:
                    command.append(word)


def halfserve_args(command: list[str]) -> list[str] | None:
    """The arguments a ``halfserve`` (or ``python -m halfserve``) command line gives the CLI; None for other
    commands."""
    if command[0] == "halfserve":
        return command[1:]
    if command[:3] == ["python", "-m", "halfserve"]:
        return command[3:]
    if command[:3] == ["python", "-m", "halfserve.loadtest"]:
        return ["loadtest", *command[3:]]
    return None


def subcommand_flags() -> dict[str, set[str]]:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    return {
        name: {s for action in sub._actions for s in action.option_strings}
        for name, sub in subparsers.items()  # type: ignore[union-attr]
    }


FLAGS = subcommand_flags()


# What a doc names exists -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    text = read(doc)
    missing = []
    for m in PATH.finditer(text):
        if re.search(r"--out[= ]$", text[: m.start()]):
            continue  # where a command shown will write: it need not be committed
        name = m.group(1).rstrip(".")
        if "*" in name or "<" in name:
            continue
        path = ROOT / name
        # A path the doc names, or the prefix of the files a run wrote (results/x for x.json and x.md).
        if not (path.exists() or any(path.parent.glob(path.name + ".*"))):
            missing.append(name)
    # Links relative to the doc itself (docs/ links up with ../).
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+:", target) and not (doc.parent / target).exists():
            missing.append(target)
    assert not missing, f"{doc_id(doc)} names what is not in the tree: {sorted(set(missing))}"


def defines(module: Path, name: str) -> bool:
    """Whether ``module`` defines (or imports) ``name`` at its top level."""
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
            return True
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        if isinstance(node, ast.Import | ast.ImportFrom) and any(
            (a.asname or a.name.split(".")[0]) == name for a in node.names
        ):
            return True
    return False


def resolves(dotted: str) -> bool:
    """Whether ``halfserve.a.b`` names a module of this tree, or a name defined at the top level of one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = SRC.joinpath(*parts[:cut])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.is_file():
            rest = parts[cut:]
            if not rest:
                return True
            if (base / "__init__.py").is_file() and (base / rest[0]).with_suffix(".py").is_file():
                return True
            return defines(module, rest[0])
    return False


DOTTED_SOURCES = [*DOCS, *sorted(PKG.rglob("*.py"))]


@pytest.mark.parametrize("source", DOTTED_SOURCES, ids=doc_id)
def test_every_module_a_doc_or_docstring_names_exists(source: Path) -> None:
    # Docstrings and comments in the package too: `server.backplane` outlived its module in two of them.
    text = read(source)
    if source.suffix == ".py":  # where Python names a module: `halfserve.x` and :mod:`halfserve.x`
        named = set(re.findall(r"`~?(halfserve(?:\.\w+)+)`", text))
    else:
        named = {m.group(0).rstrip(".") for m in MODULE.finditer(text)}
    named -= NOT_MODULES
    assert not [n for n in sorted(named) if not resolves(n)], f"{doc_id(source)} names what is not in server/halfserve/"


def test_every_file_of_the_server_the_architecture_names_exists() -> None:
    text = read(ROOT / "docs" / "architecture.md")
    names = set(re.findall(r"`([\w/]+\.py)`", text)) | {f"{n}/" for n in re.findall(r"`(\w+)/`", text)}
    missing = [
        n
        for n in sorted(names)
        if not ((ROOT / n).exists() if n.split("/")[0] in TOP else any(PKG.rglob(n.rstrip("/"))))
    ]
    assert not missing, missing


# The commands they show ------------------------------------------------------------------------------------------


def shown_commands() -> Iterator[tuple[str, list[str]]]:
    for doc in DOCS:
        for command in shell_commands(read(doc)):
            args = halfserve_args(command)
            if args is not None:
                yield doc_id(doc), args


SHOWN = list(shown_commands())


def test_the_docs_show_commands() -> None:
    assert len(SHOWN) > 20, SHOWN  # the reader above found them: a change of its parsing cannot empty this check
    assert {args[0] for _, args in SHOWN if args} >= {"serve", "import", "train", "loadtest"}


@pytest.mark.parametrize(("doc", "args"), SHOWN, ids=[f"{d}:{' '.join(a)[:60]}" for d, a in SHOWN])
def test_every_halfserve_command_shown_parses(doc: str, args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        parsed = build_parser().parse_args(args)
    except SystemExit as e:
        if args[-1:] == ["--help"] and e.code == 0:
            return
        pytest.fail(f"{doc}: `halfserve {shlex.join(args)}` does not parse: {capsys.readouterr().err.strip()}")
    assert callable(parsed.func)


INLINE_COMMAND = re.compile(r"`(?:HALFSERVE_\w+=\S+ )*halfserve (serve|import|train|loadtest)((?: [^`]*)?)`")


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_flag_of_an_inline_halfserve_command_exists(doc: str | Path) -> None:
    assert isinstance(doc, Path)
    unknown = []
    for sub, rest in INLINE_COMMAND.findall(read(doc)):
        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest):
            if flag not in FLAGS[sub]:
                unknown.append(f"halfserve {sub} {flag}")
    assert not unknown, f"{doc_id(doc)}: {unknown}"


def test_every_flag_the_failure_modes_name_is_a_serve_flag() -> None:
    # "Settings named `--flag` are `halfserve serve` flags" (docs/failure-modes.md).
    text = read(ROOT / "docs" / "failure-modes.md")
    flags = set(re.findall(r"`(--[a-z][\w-]*)", text)) - {"--flag"}  # the sentence that says so
    assert flags, "the reader found no flags"
    assert not sorted(flags - FLAGS["serve"])


def test_the_configuration_s_setting_flags_are_serve_flags() -> None:
    text = read(ROOT / "docs" / "operations.md")
    section = text[text.index("## Configuration") :]
    section = section[: section.index("\n## ", 1)]
    flags = set(re.findall(r"`(--[a-z][\w-]*)", section))
    assert flags
    assert not sorted(flags - FLAGS["serve"])


def test_the_metrics_protocol_label_s_values_are_the_interfaces() -> None:
    # The page had left out `v1`, which KServe V1's requests are counted under.
    text = read(ROOT / "docs" / "operations.md")
    row = next(line for line in text.splitlines() if line.startswith("| `halfserve_requests_total`"))
    listed = re.search(r"protocol \((.*?)\), status", row)
    assert listed, row
    assert sorted(re.findall(r"`(\w+)`(?::|,|$)", listed.group(1))) == sorted(i.value for i in Interface)


def test_the_console_script_answers_help() -> None:
    # The README's commands start with it: installed by pip install -e . as a script, and importable as a package.
    run = subprocess.run([sys.executable, "-m", "halfserve", "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert all(sub in run.stdout for sub in FLAGS)


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_code_fence_closes_on_a_line_of_its_own(doc: Path) -> None:
    # A closing fence with text after it does not close (docs/model-store.md's "``` A model in its own file" did not):
    # the site showed the prose and the commands after it as one block, where code_blocks above saw the block closed.
    wrong = []
    open_at: int | None = None
    for number, line in enumerate(read(doc).splitlines(), 1):
        fence = re.match(r"^\s*```(.*)$", line)
        if not fence:
            continue
        if open_at is None:
            if re.fullmatch(r"[\w+-]*", fence.group(1).strip()) is None:
                wrong.append(f"line {number} opens a block with text after the fence: {line!r}")
            open_at = number
        else:
            if fence.group(1).strip():
                wrong.append(f"line {number} is to close the block opened on line {open_at} but has text after it")
            open_at = None
    if open_at is not None:
        wrong.append(f"the block opened on line {open_at} never closes")
    assert not wrong, f"{doc_id(doc)}: {wrong}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_shell_block_is_valid_bash(doc: Path) -> None:
    for block in code_blocks(read(doc)):
        if block.language in {"bash", "sh", "shell"}:
            run = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True, timeout=30)
            assert run.returncode == 0, f"{doc_id(doc)}:\n{block.text}\n{run.stderr}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_a_server_started_in_the_background_is_waited_for_and_stopped(doc: Path) -> None:
    # A request sent the moment `halfserve serve ... &` returns finds no server yet (the models load first), and a
    # server left behind holds its ports against the next example.
    for block in code_blocks(read(doc)):
        if block.language not in SHELLS:
            continue
        lines = block.text.replace("\\\n", " ").splitlines()
        for i, line in enumerate(lines):
            if re.search(r"\bhalfserve serve\b.*&\s*(#.*)?$", line):
                rest = "\n".join(lines[i + 1 :])
                assert "/ready" in rest, f"{doc_id(doc)}: nothing waits for /ready after: {line}"
                assert re.search(r"^kill ", rest, re.M), f"{doc_id(doc)}: nothing stops the server of: {line}"


# The import table -------------------------------------------------------------------------------------------------


def module_of(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def server_imports(path: Path) -> set[str]:
    """The server modules ``path`` imports (packages as themselves: ``halfserve.api``, not its route modules)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        for name in names:
            parts = name.split(".")
            if parts[0] != "halfserve" or len(parts) < 2:
                continue
            base = PKG / parts[1]
            if base.is_dir() or base.with_suffix(".py").is_file():
                found.add(f"halfserve.{parts[1]}")
    return found


def import_table() -> dict[str, tuple[set[str], set[str]]]:
    """docs/architecture.md's table: each part's modules and the modules it is documented to import."""
    text = read(ROOT / "docs" / "architecture.md")
    table = text[text.index("| part | modules | imports |") :].split("\n\n", 1)[0]
    parts = {}
    for row in table.splitlines()[2:]:
        part, modules, imports = (c.strip() for c in row.strip("|").split("|"))
        own = {"halfserve." + m.removesuffix(".py").rstrip("/") for m in re.findall(r"`([^`]+)`", modules)}
        named = {"halfserve." + m for m in re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", imports))}
        parts[part] = (own, named)
    return parts


TABLE = import_table()


@pytest.mark.parametrize("part", [p for p in TABLE if not p.startswith("app")])
def test_the_import_table_is_each_parts_imports(part: str) -> None:
    own, documented = TABLE[part]
    actual = set()
    for path in sorted(PKG.rglob("*.py")):
        name = module_of(path)
        if any(name == m or name.startswith(m + ".") for m in own):
            actual |= server_imports(path)
    actual -= own
    assert (sorted(actual - documented), sorted(documented - actual)) == ([], []), "(undocumented, not imported)"

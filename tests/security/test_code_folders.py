"""The operator's code folders and the model store: a ``--code-path`` folder that is the store itself or lies in a
model folder (the one an import is writing included) is refused at the start of ``halfserve import`` and of serving,
naming the flag, the folder and why, before anything is written; imports write model folders from archives, so a code
folder there would make what an archive ships run. A folder of the store's that is no model's (``<store>/code``)
stays the operator's while it is none, and an ``--archive-code`` folder's files never land in the store.

An archive's code goes into the operator's folders only once its import is accepted: one refused at any step, however
late, leaves the code folder exactly as it was, and one whose Python files would shadow ``ts`` (the package TorchServe
handlers run with), ``halfserve`` or a standard library module is refused with the reason."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from halfserve import models, storage
from halfserve.app import create_app
from halfserve.codecopies import CodeCopies
from halfserve.settings import Settings
from halfserve.storage import StoreError
from tests.conftest import save_tiny_mlp
from tests.integration.test_mar_handler_file import INPUT, OWN_INFERENCE, STRICT, handler_archive
from tests.integration.test_mar_import import archive, import_mar, tiny_net


def listing(folder: Path) -> list[str]:
    """Every path under ``folder``, relative to it, sorted: what an import wrote shows as a difference."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) if folder.exists() else []


@pytest.mark.parametrize(
    ("where", "reason"),
    [
        ("", "is the model store itself"),
        ("tiny", "lies in the model folder"),
        ("tiny/1", "lies in the model folder"),
        ("tinynet", "lies in the model folder"),  # the folder of the model being imported, not written yet
    ],
    ids=["store", "model", "version", "imported"],
)
def test_an_import_refuses_a_code_path_in_the_store_s_model_folders_before_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str, reason: str
) -> None:
    store = tmp_path / "store"
    save_tiny_mlp(store)
    mar, folder = archive(tmp_path / "x.mar", tiny_net()), store / where
    before = listing(store)
    assert import_mar(mar, store, "--trust-model-file", "--code-path", str(folder)) == 2
    err = capsys.readouterr().err
    assert f"--code-path {folder}: {reason}" in err, err
    assert listing(store) == before  # no mar_tinynet.py, no model folder


def test_an_archive_s_file_bound_for_the_store_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An ``--archive-code`` folder holding the store: the archive's ``.py`` files keep their paths in the archive, so
    ``store/tinynet/pwn.py`` would have landed in the imported model's folder."""
    store = tmp_path / "store"
    files = {"strict_handler.py": STRICT.encode(), "store/tinynet/pwn.py": b"print('ran')\n"}
    mar = archive(tmp_path / "x.mar", tiny_net(), handler="strict_handler.py", **files)
    flags = ["--trust-model-file", "--code-path", str(tmp_path / "model_code"), "--archive-code", str(tmp_path)]
    assert import_mar(mar, store, *flags) == 2
    assert "the archive's store/tinynet/pwn.py would land in the store" in capsys.readouterr().err
    assert not (store / "tinynet").exists()


async def test_serving_refuses_a_code_path_in_a_model_folder_at_start(tmp_path: Path) -> None:
    store = tmp_path / "store"
    save_tiny_mlp(store)
    app = create_app(Settings(store=store, code_path=[store / "tiny"]))
    with pytest.raises(StoreError, match=r"--code-path .*tiny: lies in the model folder"):
        async with app.router.lifespan_context(app):
            pass


def test_a_code_folder_in_the_store_runs_nothing_once_it_is_a_model_folder(tmp_path: Path) -> None:
    """``<store>/later`` is the operator's at start-up; an import naming a model ``later`` makes it a model folder,
    whose modules are refused from then on, before they are imported."""
    store, later = tmp_path / "store", tmp_path / "store" / "later"
    save_tiny_mlp(store)
    later.mkdir()
    (later / "opcode_later.py").write_text(textwrap.dedent("def build() -> None:\n    return None\n"))
    before = list(sys.path)
    try:
        models.add_code_path([later])
        models.forbid_store(store)
        assert models.check_source("opcode_later", "opcode_later:build") is models.Source.CODE_PATH
        (later / storage.MANIFEST).write_text("{}")
        with pytest.raises(models.UnknownArchitectureError, match="lies in the model store"):
            models.check_source("opcode_later", "opcode_later:build")
    finally:
        sys.path[:] = before


MISSING_HELPER = """
import opcode_absent_helper
from ts.torch_handler.base_handler import BaseHandler


class NeedsHelper(BaseHandler):
    pass
"""
OTHER_NET = """
from torch import nn


class OtherNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 10)

    def forward(self, x):
        return self.head(x.mean((2, 3)))
"""


def refused_late(tmp_path: Path, case: str) -> tuple[Path, list[str]]:
    """An archive refused at ``case``'s step, and the flags that copy its code into ``tmp_path / "code"``."""
    code = ["--trust-model-file", "--code-path", str(tmp_path / "code"), "--archive-code", str(tmp_path / "code")]
    if case == "inference":  # refused where the handler is built, after the model was built from the model file
        return handler_archive(tmp_path, OWN_INFERENCE, "own_inference"), [*code, *INPUT]
    if case == "missing-module":
        return handler_archive(tmp_path, MISSING_HELPER, "needs_helper"), [*code, *INPUT]
    if case == "weights":  # the model file builds a net the weights do not fit
        mar = archive(tmp_path / "x.mar", tiny_net(), **{"model.py": OTHER_NET.encode()})
        return mar, code[:3]
    package = {"ts": "ts/__init__.py", "halfserve": "halfserve.py", "stdlib": "csv.py", "installed": "numpy.py"}[case]
    files = {"strict_handler.py": STRICT.encode(), package: b"print('ran')\n"}
    return archive(tmp_path / "x.mar", tiny_net(), handler="strict_handler.py", **files), code


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("inference", "OwnInference overrides inference"),
        ("missing-module", "opcode_absent_helper"),
        ("weights", "OtherNet"),
        ("ts", "the archive's ts/__init__.py is a top-level module 'ts', which would shadow the ts package"),
        ("halfserve", "the archive's halfserve.py is a top-level module 'halfserve', which would shadow the server"),
        ("stdlib", "the archive's csv.py is a top-level module 'csv', which would shadow the standard library module"),
        ("installed", "the archive's numpy.py is a top-level module 'numpy', the name of a module this environment"),
    ],
)
def test_a_refused_import_leaves_the_code_folder_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, reason: str
) -> None:
    code, store = tmp_path / "code", tmp_path / "store"
    code.mkdir()
    (code / "mine.py").write_text("# the operator's own\n")
    mar, flags = refused_late(tmp_path, case)
    assert import_mar(mar, store, *flags) == 2
    err = capsys.readouterr().err
    assert reason in err, err
    assert listing(code) == ["mine.py"]
    assert not (store / "tinynet").exists()


def test_a_code_folder_an_import_made_is_gone_when_it_is_refused(tmp_path: Path) -> None:
    mar, flags = refused_late(tmp_path, "weights")
    assert import_mar(mar, tmp_path / "store", *flags) == 2
    assert not (tmp_path / "code").exists()


def test_an_archive_shipping_ts_leaves_the_folder_to_the_next_torchserve_handler(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Such an archive, refused, left ``code/ts/`` behind: every torchserve-style handler served from the folder
    after it was refused as TorchServe's own ``ts`` being installed."""
    mar, flags = refused_late(tmp_path, "ts")
    assert import_mar(mar, tmp_path / "store", *flags) == 2
    capsys.readouterr()
    strict = handler_archive(tmp_path, STRICT, "strict_handler")
    assert import_mar(strict, tmp_path / "store", *flags) == 0, capsys.readouterr().err
    assert [p.name for p in (tmp_path / "code").iterdir() if p.name.startswith((".", "ts"))] == []
    # Built from the staging folder, the handler is imported again from the code folder by a server in this process
    # (an instance process is handed its source from there).
    staged = [n for n, m in sys.modules.items() if ".halfserve-import-" in str(getattr(m, "__file__", None))]
    assert staged == []


def test_a_code_folder_comes_after_the_installed_packages(tmp_path: Path) -> None:
    """A file in a --code-path folder named as a module the server imports (uvloop.py, numpy.py) is never what the
    server, a library or a spawned process (which starts from this path) gets; the folder's own modules still import."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "orjson.py").write_text("raise SystemExit('the code folder shadowed an installed module')\n")
    (code / "opcode_own_module.py").write_text("VALUE = 7\n")
    before = list(sys.path)
    try:
        models.add_code_path([code])
        spec = importlib.util.find_spec("orjson")
        assert spec is not None
        assert spec.origin is not None
        assert not Path(spec.origin).resolve().is_relative_to(code.resolve()), spec.origin
        own = importlib.util.find_spec("opcode_own_module")
        assert own is not None
        assert own.origin == str(code.resolve() / "opcode_own_module.py")
    finally:
        sys.path[:] = before


def test_two_imports_into_one_code_folder_run_one_after_the_other(tmp_path: Path) -> None:
    """The second import's checks and copies wait for the first to finish (install or discard): it never finds the
    first's files appearing midway, and never refuses after its model was written."""
    code = tmp_path / "code"
    code.mkdir()
    first, second = CodeCopies(), CodeCopies()
    first.hold(code)
    held = threading.Event()

    def hold() -> None:
        second.hold(code / "not-yet-made")  # the nearest folder that exists is the one held
        held.set()

    waiter = threading.Thread(target=hold)
    waiter.start()
    try:
        assert not held.wait(0.5)  # cannot pass while the first holds it, however slow the host
        first.discard()
        assert held.wait(30)
    finally:
        first.discard()
        waiter.join(30)
        second.discard()
    assert listing(code) == []


def test_a_staging_folder_a_killed_import_left_is_removed_by_the_next(tmp_path: Path) -> None:
    code = tmp_path / "code"
    stale = code / f"{CodeCopies.STAGING}killed"
    stale.mkdir(parents=True)
    (stale / "mar_x.py").write_text("# staged by an import killed with -9\n")
    (code / "mine.py").write_text("# the operator's own\n")
    copies = CodeCopies()
    try:
        copies.hold(code)
    finally:
        copies.discard()
    assert listing(code) == ["mine.py"]

"""The operator's code folders and the model store: a ``--code-path`` folder that is the store itself or lies in a
model folder (the one an import is writing included) is refused at the start of ``halfserve import`` and of serving,
naming the flag, the folder and why, before anything is written; imports write model folders from archives, so a code
folder there would make what an archive ships run. A folder of the store's that is no model's (``<store>/code``)
stays the operator's while it is none, and an ``--archive-code`` folder's files never land in the store."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from halfserve import models, storage
from halfserve.app import create_app
from halfserve.settings import Settings
from halfserve.storage import StoreError
from tests.conftest import save_tiny_mlp
from tests.integration.test_mar_handler_file import STRICT
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

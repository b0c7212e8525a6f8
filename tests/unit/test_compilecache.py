"""The compile cache's pieces: its key, the digest checked before torch sees an entry, the folder it may use, and an
entry torch cannot read (the round trip through real compiles is tests/e2e/test_compile_cache.py)."""

from __future__ import annotations

import importlib
import logging
import os
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from halfserve import aoti, codedigest, compilecache, models, store
from halfserve.compilecache import CacheOutcome, CacheUse, CompileCache, CorruptEntry
from halfserve.engine.core import Engine
from halfserve.execution import Execution
from halfserve.manifest import Manifest, Precision, TensorSpec
from halfserve.settings import Settings
from tests.conftest import OPERATOR_NET, save_tiny_mlp

PARTS = {"model": "digits", "version": 1, "precision": "bf16", "torch": "2.13.0", "buckets": [1, 8]}


def test_a_key_changes_with_every_part_and_not_with_their_order() -> None:
    base = compilecache.key(PARTS)
    assert compilecache.key(dict(reversed(PARTS.items()))) == base
    changed = [
        {**PARTS, "precision": "fp16"},
        {**PARTS, "torch": "2.13.1"},
        {**PARTS, "version": 2},
        {**PARTS, "buckets": [1, 16]},
        {**PARTS, "fp32_modules": ["fc2"]},
    ]
    keys = {compilecache.key(p) for p in changed}
    assert base not in keys
    assert len(keys) == len(changed)


def test_the_runtime_parts_name_this_torch_and_device() -> None:
    parts = compilecache.runtime_parts(torch.device("cpu"), "Some CPU")
    assert parts["torch"] == torch.__version__
    assert str(parts["device"]).startswith("Some CPU (")


def test_an_entry_reads_back_and_a_changed_byte_is_refused(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path)
    assert cache.read("k") is None
    cache.write("k", b"artifacts")
    assert cache.read("k") == b"artifacts"
    entry = tmp_path / "k.artifacts"
    assert entry.stat().st_mode & 0o077 == 0  # the server user's alone
    entry.write_bytes(b"artifactZ")
    with pytest.raises(CorruptEntry, match="digest"):
        cache.read("k")
    (tmp_path / "k.sha256").unlink()
    with pytest.raises(CorruptEntry, match="missing"):
        cache.read("k")


def test_an_oversized_entry_is_refused_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = CompileCache(tmp_path)
    cache.write("k", b"12345678")
    monkeypatch.setattr(compilecache, "MAX_ENTRY_BYTES", 4)
    with pytest.raises(CorruptEntry, match="more than an entry may"):
        cache.read("k")


def test_the_oldest_entries_go_past_the_folder_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compilecache, "MAX_FOLDER_BYTES", 10)
    cache = CompileCache(tmp_path)
    cache.write("old", b"123456")
    os.utime(tmp_path / "old.artifacts", (1, 1))
    cache.write("new", b"123456")
    assert cache.read("old") is None
    assert not (tmp_path / "old.sha256").exists()
    assert cache.read("new") == b"123456"


def test_a_folder_others_can_write_to_is_not_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="halfserve.compilecache"):
        assert not CompileCache(shared).usable
    assert "others can write to it" in caplog.text
    own = CompileCache(tmp_path / "made" / "here")
    assert own.usable
    assert (tmp_path / "made" / "here").is_dir()


def test_a_file_where_the_folder_should_be_is_not_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_text("")
    with caplog.at_level(logging.WARNING, logger="halfserve.compilecache"):
        assert not CompileCache(tmp_path / "file" / "cache").usable
    assert "not used" in caplog.text


def test_the_setting_names_the_folder(tmp_path: Path) -> None:
    store = tmp_path / "store"
    auto = compilecache.from_setting(Settings(store=store).compile_cache, store)
    assert auto is not None
    assert auto.folder == store / ".cache" / "compile"
    assert compilecache.from_setting("off", store) is None
    given = compilecache.from_setting(str(tmp_path / "elsewhere"), store)
    assert given is not None
    assert given.folder == tmp_path / "elsewhere"


def test_a_folder_inside_a_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="compile_cache: .* inside a model's folder"):
        Settings(store=tmp_path, compile_cache=str(tmp_path / "digits" / "1" / "cache"))
    Settings(store=tmp_path, compile_cache=str(tmp_path / ".cache" / "mine"))  # a hidden folder is no model


def test_an_entry_torch_cannot_read_is_rebuilt_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = CompileCache(tmp_path)
    cache.write("k", compilecache.pack([b"not torch's artifacts"]))  # its digest matches: torch is to refuse it
    use = CacheUse()
    with caplog.at_level(logging.WARNING, logger="halfserve.compilecache"):
        compilecache._load(cache, "k", use)
    assert use.outcome is CacheOutcome.CORRUPT
    ours = [r for r in caplog.records if r.name == "halfserve.compilecache"]
    assert len(ours) == 1
    assert "rebuilt, not used" in ours[0].getMessage()


def test_an_altered_entry_never_reaches_torch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = CompileCache(tmp_path)
    cache.write("k", b"artifacts")
    (tmp_path / "k.artifacts").write_bytes(b"artifactZ")
    seen: list[bytes] = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", seen.append)
    use = CacheUse()
    with caplog.at_level(logging.WARNING, logger="halfserve.compilecache"):
        compilecache._load(cache, "k", use)
    assert use.outcome is CacheOutcome.CORRUPT
    assert seen == []
    assert "does not match its digest" in caplog.text


def test_torchs_kernel_cache_goes_with_the_entries_unless_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    compilecache.keep_kernels(CompileCache(tmp_path))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "torchinductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/operator/named")
    compilecache.keep_kernels(CompileCache(tmp_path))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/operator/named"


def test_an_inductor_engine_moves_torchs_kernel_cache_before_it_compiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # torch.compile would set it to torch's default
    save_tiny_mlp(tmp_path, execution=Execution(compile="inductor"))
    cache = CompileCache(tmp_path / "cache")
    engine = Engine(store.load(tmp_path, "tiny"), Precision.FP32, torch.device("cpu"), compile_cache=cache)
    engine.close()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "torchinductor")


def test_an_entry_holds_each_save_whole() -> None:
    parts = [b"first save", b"a recompile's save"]
    assert compilecache.unpack(compilecache.pack(parts)) == parts
    with pytest.raises(CorruptEntry, match="do not add up"):
        compilecache.unpack(compilecache.pack(parts)[:-1])
    with pytest.raises(CorruptEntry, match="do not add up"):
        compilecache.unpack(bytes(8) + b"x")


AOTI = Execution(compile="aoti")


@pytest.fixture
def operator_model(operator_code: Path, tmp_path: Path) -> Path:
    """A store whose model ``op`` is built by the operator's ``--code-path`` module ``opkey_net``, compiled with
    AOTInductor; returns the module's file."""
    code = operator_code / "opkey_net.py"
    code.write_text(OPERATOR_NET)
    importlib.invalidate_caches()
    models.add_code_path([operator_code])
    torch.manual_seed(0)
    manifest = Manifest(
        name="op",
        architecture="opkey_net:build",
        inputs=[TensorSpec(name="x", shape=[6])],
        outputs=[TensorSpec(name="y", shape=[4])],
        execution=AOTI,
    )
    store.save(tmp_path / "store", manifest, models.build("opkey_net:build"))
    return code


def aoti_key(root: Path, cache: CompileCache) -> str | None:
    """The key of model ``op``'s AOTInductor entry as a fresh load (a restart) makes it."""
    engine = Engine(store.load(root, "op"), Precision.FP32, torch.device("cpu"), compile_cache=cache)
    try:
        return compilecache.engine_key(engine, [1, 8])
    finally:
        engine.close()


def test_an_aoti_key_changes_with_the_code_the_weights_and_halfserve(
    operator_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, cache = tmp_path / "store", CompileCache(tmp_path / "cache")
    base = aoti_key(root, cache)
    assert base is not None
    assert aoti_key(root, cache) == base  # the same model, version, code and host: its entry is found
    operator_model.write_text(OPERATOR_NET.replace("return self.l(x)", "return self.l(x) * 2"))
    edited = aoti_key(root, cache)  # the team's edit, same name, version and architecture
    assert edited not in {base, None}
    torch.manual_seed(1)
    store.write_weights(root / "op" / "1", models.build("opkey_net:build"), {"name": "op"})
    rewritten = aoti_key(root, cache)  # other weights under the same version number
    assert rewritten not in {base, edited, None}
    monkeypatch.setattr(compilecache, "__version__", "0.0.0-other")
    assert aoti_key(root, cache) not in {base, edited, rewritten, None}


def test_an_aoti_engine_whose_code_cannot_be_digested_compiles_without_the_cache(
    operator_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(codedigest, "MAX_FILES", 0)  # past the bound: its code cannot be told
    handed: list[object] = []

    def packaged(*args: object) -> tuple[object, float]:
        handed.append(args[5])  # the cache and key it would read and write
        return lambda t: t, 0.0

    monkeypatch.setattr(aoti, "packaged", packaged)
    cache = CompileCache(tmp_path / "cache")
    engine = Engine(store.load(tmp_path / "store", "op"), Precision.FP32, torch.device("cpu"), compile_cache=cache)
    try:
        with caplog.at_level(logging.INFO, logger="halfserve.compilecache"):
            assert compilecache.engine_key(engine, [1, 8]) is None
            engine._load_packages([1, 8])
    finally:
        engine.close()
    assert handed == [None]
    said = [r.getMessage() for r in caplog.records if "compile cache not used" in r.getMessage()]
    assert len(said) == 1
    assert "opkey_net:build" in said[0]
    assert "cannot be digested" in said[0]


def test_an_inductor_key_leaves_the_code_and_files_to_torchs_own_keys(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path, execution=Execution(compile="inductor"))
    engine = Engine(store.load(tmp_path, "tiny"), Precision.FP32, torch.device("cpu"))
    try:
        first = compilecache.engine_key(engine, [1, 8])
        torch.manual_seed(1)
        store.write_weights(tmp_path / "tiny" / "1", torch.nn.Linear(1, 1), {"name": "tiny"})
        assert compilecache.engine_key(engine, [1, 8]) == first
        assert "built_from" not in engine.__dict__  # nothing digested for it
    finally:
        engine.close()

"""The engine's shape (docs/architecture.md): one runner per placement behind one protocol, modules that each hold one
idea, and a model's engine typed by that protocol rather than a union of its classes."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from halfserve.engine import protocol
from halfserve.engine.core import Engine
from halfserve.engine.loop import LoopRunner
from halfserve.engine.pipelined import PipelinedRunner
from halfserve.engine.threads import ThreadRunner
from halfserve.isolated.engine import ProcessEngine
from halfserve.placement import Placement

PKG = Path(__file__).resolve().parents[2] / "server" / "halfserve"


def members(cls: type) -> set[str]:
    """The names a protocol declares: its methods, properties and annotated attributes."""
    declared = {n for n, v in vars(cls).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return declared | {n for n in getattr(cls, "__annotations__", {}) if not n.startswith("_")}


def provides(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` have ``name``: a class attribute, or one its ``__init__`` assigns."""
    if hasattr(cls, name):
        return True
    tree = ast.parse(inspect.getsource(cls))
    return any(
        isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.ctx, ast.Store)
        for node in ast.walk(tree)
    )


@pytest.mark.parametrize("cls", [Engine, ProcessEngine])
def test_both_engines_offer_everything_the_protocol_declares(cls: type) -> None:
    missing = sorted(n for n in members(protocol.ModelEngine) if not provides(cls, n))
    assert not missing, missing


@pytest.mark.parametrize(
    ("runner", "placement"),
    [
        (ThreadRunner, Placement.INSTANCE_THREADS),
        (LoopRunner, Placement.EVENT_LOOP),
        (PipelinedRunner, Placement.BESIDE_LOOP),
    ],
)
def test_each_in_process_placement_has_a_runner_of_its_own(runner: type, placement: Placement) -> None:
    assert runner.placement is placement  # type: ignore[attr-defined]
    missing = sorted(n for n in members(protocol.BatchRunner) if not provides(runner, n))
    assert not missing, missing


def test_the_engine_is_a_package_and_its_runners_are_modules_of_their_own() -> None:
    assert not (PKG / "engine.py").exists()
    assert {"core.py", "protocol.py", "threads.py", "loop.py", "pipelined.py", "traced.py"} <= {
        p.name for p in (PKG / "engine").glob("*.py")
    }


def test_a_served_model_s_engine_is_typed_by_the_protocol_not_a_union() -> None:
    served, repository = ((PKG / name).read_text() for name in ("served.py", "repository.py"))
    assert "Engine | ProcessEngine" not in served + repository
    assert "engine: ModelEngine | None" in served


def test_instance_processes_are_supervised_by_a_module_of_their_own() -> None:
    """The dispatch (``isolated/engine.py``), the wire end (``isolated/wire.py``) and the supervision (start,
    watchdog, restarts) are three modules: the supervisor knows a process only through its protocol, never the wire."""
    from halfserve.isolated import engine, supervision

    assert {"Supervisor", "Watchdog", "end", "RESPAWN_DELAYS_S"} <= set(vars(supervision))
    assert not hasattr(engine.ProcessEngine, "_respawn")
    source = (PKG / "isolated" / "supervision.py").read_text()
    for module in ("halfserve.isolated.engine", "halfserve.isolated.wire"):
        assert module not in source.replace(f"`{module}`", ""), module  # named in its docstring, never imported

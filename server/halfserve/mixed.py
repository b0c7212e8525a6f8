"""Mixed precision by measurement: the fewest modules kept in fp32 so a model that falls below its fidelity bar in
half precision meets it, the rest still half.

Usually what half precision breaks is small: a final projection whose scores differ by less than bf16 resolves, one
layer whose outputs cancel. Serving the whole model in fp32 for it gives up every bit of half precision's speed and
memory. A *plan* names the modules kept in fp32 (:func:`halfserve.precision.keep_fp32`): their weights stay fp32 and
their floating inputs are cast up on the way in; every other module with parameters casts its inputs to the half
dtype, so every boundary sees the dtype it expects, and a kept last projection answers with its fp32 scores.

The search (:func:`search`):

1. ranks the modules that hold parameters by their *centred error* on the samples: how far each one's half output is
   from what the same module computes in fp32 on the same input, against how much its fp32 output varies across its
   own features. A layer whose outputs differ among themselves by less than the half dtype resolves scores high,
   whatever the size of the outputs; a healthy layer scores about the dtype's rounding (:func:`rank`);
2. measures the model with every candidate in fp32: when even that misses the bar (the fragile part has no
   parameters, or is the whole model), there is no plan;
3. bisects the length of the ranked prefix, measuring each with the real fidelity check, to the shortest one that
   meets the bar. Bisection takes a longer prefix to do no worse, which a sample whose answer is a small difference
   of large terms can break (each rounding left before it moves it by about its own size, one way or the other): a
   shorter plan may then be missed, never an unmeasured one served.

Every measurement is the load's own (:func:`halfserve.fidelity.measure` against the host's fp32 weights, on the same
samples), and the search stops at a time limit (``mixed_search_seconds``): what it found by then, or no plan.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from halfserve import fidelity
from halfserve.engine.core import Engine
from halfserve.fidelity import Bar, Fidelity, shortfall
from halfserve.manifest import Precision
from halfserve.precision import cast_floating
from halfserve.store import LoadedModel

HALVES = (Precision.FP16, Precision.BF16)
"""The precisions a plan applies to: their weights are cast, so modules can be kept apart (autocast casts per op)."""

IMPORT_LIMIT_S = 120.0
"""How long ``halfserve import`` searches (the server's own limit is ``mixed_search_seconds``)."""

RANK_ROWS = 64
"""Samples the ranking runs (each module twice): ranking needs few; every measurement runs them all."""

Measure = Callable[[tuple[str, ...]], Fidelity]
"""Build an engine keeping the given modules in fp32 and measure it against fp32 on the samples."""


def candidates(model: nn.Module) -> list[str]:
    """The modules a plan may keep in fp32: those holding parameters of their own, in the model's order."""
    return [name for name, m in model.named_modules() if name and any(True for _ in m.parameters(recurse=False))]


def _first_tensor(value: Any) -> torch.Tensor | None:
    return next((t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()), None)


def centred_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """How far ``got`` is from ``want`` against how much ``want`` varies across its last dimension: about the dtype's
    rounding for a healthy layer, 1 or more where the outputs differ by less than the dtype resolves."""
    got, want = (t.detach().double() for t in (got, want))
    got, want = (t.flatten(1) if t.dim() > 1 else t[:, None] for t in (got, want))
    spread = want - want.mean(dim=1, keepdim=True)
    scale = float(spread.norm()) if want.shape[1] > 1 else float(want.norm())
    error = float((got - want).norm())
    if not math.isfinite(error):
        return math.inf
    return error / scale if scale > 0 else (0.0 if error == 0 else math.inf)


RANK_GROUPS = 4
"""The ranking's fp32 twins are made for about a quarter of the model's parameters at a time (one module at least),
so ranking holds that much beside the model, not a second fp32 copy of it, for a few more runs of the samples."""


def rank(
    model: nn.Module, run: Callable[[], object], names: Sequence[str], groups: int = RANK_GROUPS
) -> list[tuple[str, float]]:
    """``names`` (modules of ``model``, cast to a half dtype) by their centred error while ``run`` runs the samples
    through ``model``, highest first; each module's fp32 twin computes the reference on the same inputs. The twins
    are made for one group of modules at a time (:func:`twin_groups`), ``run`` once per group."""
    scores: dict[str, float] = dict.fromkeys(names, 0.0)

    def hook(name: str, twin: nn.Module) -> Callable[..., None]:
        def record(_module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            got = _first_tensor(output)
            if got is None:
                return
            with torch.inference_mode():
                want = _first_tensor(twin(*cast_floating(args, torch.float32), **cast_floating(kwargs, torch.float32)))
            if want is not None and want.shape == got.shape:
                scores[name] = max(scores[name], centred_error(got, want))

        return record

    for group in twin_groups(model, names, groups):
        handles = []
        try:
            for name in group:
                module = model.get_submodule(name)
                twin = copy.deepcopy(module).float()
                for part in twin.modules():  # a plan's casts came along with the copy: the twin computes in fp32 alone
                    part._forward_pre_hooks.clear()
                    part._forward_hooks.clear()
                handles.append(module.register_forward_hook(hook(name, twin), with_kwargs=True))
            run()
        finally:
            for h in handles:  # the hooks hold the twins: removed, the group's twins are freed
                h.remove()
    return sorted(scores.items(), key=lambda kv: -kv[1])


def twin_groups(model: nn.Module, names: Sequence[str], groups: int) -> list[list[str]]:
    """``names`` in runs of modules whose fp32 parameters add up to at most ``1 / groups`` of the whole model's (a
    larger module alone), in order."""
    sizes = [sum(p.numel() for p in model.get_submodule(n).parameters()) for n in names]
    budget = sum(p.numel() for p in model.parameters()) / max(groups, 1)
    out: list[list[str]] = []
    held = 0
    for name, size in zip(names, sizes, strict=True):
        if out and out[-1] and held + size <= budget:
            out[-1].append(name)
            held += size
        else:
            out.append([name])
            held = size
    return out


@dataclass
class Plan:
    """Modules kept in fp32 and what the model measured with them."""

    precision: Precision
    modules: tuple[str, ...]
    fidelity: Fidelity
    candidates: int
    """How many modules could have been kept in fp32."""
    parameters_fp32: float
    """The share of the model's parameters kept in fp32."""
    seconds: float
    measurements: int

    def as_dict(self) -> dict[str, object]:
        return {
            "precision": self.precision.value,
            "fp32_modules": list(self.modules),
            "candidates": self.candidates,
            "parameters_fp32": round(self.parameters_fp32, 6),
            "fidelity": self.fidelity.as_dict(),
            "search_seconds": round(self.seconds, 3),
            "measurements": self.measurements,
        }


@dataclass
class Outcome:
    """What a search found: a plan, or why there is none."""

    plan: Plan | None
    reason: str | None = None
    tried: list[tuple[int, str | None]] = field(default_factory=list)
    """(prefix length, shortfall or None) per measurement, in order."""
    ranked: list[tuple[str, float]] = field(default_factory=list)
    """The candidates by centred error, highest first."""

    def as_dict(self) -> dict[str, object]:
        return {
            "plan": self.plan.as_dict() if self.plan is not None else None,
            "reason": self.reason,
            "most_sensitive": [{"module": n, "centred_error": round(e, 6)} for n, e in self.ranked[:5]],
        }


def parameter_share(model: nn.Module, names: Sequence[str]) -> float:
    total = sum(p.numel() for p in model.parameters())
    kept = sum(p.numel() for n in names for p in model.get_submodule(n).parameters())
    return kept / total if total else 0.0


def search(
    ranked: Sequence[str],
    measure: Measure,
    held_to: Bar,
    model: nn.Module,
    precision: Precision,
    limit_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> Outcome:
    """The shortest prefix of ``ranked`` that, kept in fp32, meets ``held_to`` (see the module), measuring each try
    with ``measure``; stops once ``limit_s`` seconds of ``clock`` have passed (then the best plan met so far)."""
    started = clock()
    outcome = Outcome(None)
    if not ranked:
        outcome.reason = "the model has no module with parameters to keep in fp32"
        return outcome
    best: tuple[int, Fidelity] | None = None
    if limit_s <= 0:
        outcome.reason = "the search's time limit (mixed_search_seconds) passed before a plan was measured"
        return outcome

    def met(k: int) -> bool:
        nonlocal best
        try:
            fidelity = measure(tuple(ranked[:k]))
        except Exception as e:  # a plan the model cannot run (an op given fp32 and half tensors at once) is no plan
            outcome.tried.append((k, f"failed to run: {type(e).__name__}: {e}"))
            return False
        missed = shortfall(fidelity, held_to)
        outcome.tried.append((k, missed))
        if missed is None and (best is None or k < best[0]):
            best = (k, fidelity)
        return missed is None

    if not met(len(ranked)):
        outcome.reason = (
            f"keeping all {len(ranked)} modules with parameters in fp32 still misses the bar: {outcome.tried[-1][1]}"
        )
        return outcome
    low, high = 0, len(ranked)  # high meets the bar; low is known not to (no module kept is the shortfall measured)
    while high - low > 1:
        if clock() - started > limit_s:
            break
        mid = (low + high) // 2
        if met(mid):
            high = mid
        else:
            low = mid
    assert best is not None
    k, fidelity = best
    if k == len(ranked):
        which = "its one module" if k == 1 else f"all {k} modules"
        outcome.reason = f"only keeping {which} with parameters in fp32 meets the bar: that is the fp32 model"
        return outcome
    modules = tuple(ranked[:k])
    outcome.plan = Plan(
        precision,
        modules,
        fidelity,
        len(ranked),
        parameter_share(model, modules),
        clock() - started,
        len(outcome.tried),
    )
    return outcome


def find(
    loaded: LoadedModel,
    precision: Precision,
    device: torch.device,
    held_to: Bar,
    limit_s: float,
    batch: int,
    clock: Callable[[], float] | None = None,
    stored: tuple[str, ...] = (),
    samples: fidelity.Samples | None = None,
) -> Outcome:
    """Search a plan for ``loaded`` in ``precision`` on its fidelity samples (calibration, else random), each try an
    engine of its own measured against the host's fp32 weights; it blocks (seconds to minutes), so run it off the
    event loop. Samples the model cannot run (random ones past what it takes) give no plan, with the reason. A plan
    ``stored`` with the version (its precision record's, found at import) is measured first and served if it still
    meets the bar: one measurement, not a search. ``samples``: those the load already read, else read here."""
    clock = clock or time.monotonic
    started = clock()

    def build(plan: tuple[str, ...]) -> Engine:
        return Engine(loaded, precision, device, max_batch_size=batch, fp32_modules=plan)

    try:
        rows = samples if samples is not None else fidelity.samples(loaded)
        ranking = build(())
        try:
            ranked = rank(ranking.model, lambda: ranking.compute(rows.rows[:RANK_ROWS]), candidates(ranking.model))
        finally:
            ranking.close()
    except Exception as e:  # the half precision is then unproven, as it is without a search
        return Outcome(None, f"the search could not run the samples: {type(e).__name__}: {e}")

    def measure(plan: tuple[str, ...]) -> Fidelity:
        engine = build(plan)
        try:
            return fidelity.measure(engine, loaded, rows.rows, batch, rows.source)
        finally:
            engine.close()

    names = [n for n, _ in ranked]
    if stored and set(stored) <= set(names) and len(stored) < len(names):
        try:
            again = measure(stored)
        except Exception:  # noqa: BLE001 - a stored plan that no longer runs is searched again, as none would be
            again = None
        if again is not None and shortfall(again, held_to) is None:
            share, seconds = parameter_share(loaded.module, stored), clock() - started
            plan = Plan(precision, stored, again, len(names), share, seconds, 1)
            return Outcome(plan, "the version's stored plan, measured again at load", [(len(stored), None)], ranked)
    left = limit_s - (clock() - started)
    outcome = search([n for n, _ in ranked], measure, held_to, loaded.module, precision, left, clock)
    outcome.ranked = ranked
    if outcome.plan is not None:
        outcome.plan.seconds = clock() - started
    return outcome


def said(found: Outcome | None, half: str, figures: Callable[[Fidelity], str]) -> list[str]:
    """What ``halfserve import`` says of its search for a plan, each figure as ``figures`` words it."""
    plan = found.plan if found is not None else None
    if plan is None:
        why = f" (no mixed-precision plan: {found.reason})" if found is not None else ""
        return [f"  The server will serve this model in fp32, not {half}{why}: {fidelity.how_to_override(half)}."]
    return [
        f"  mixed precision: {half} with {len(plan.modules)} of {plan.candidates} modules in fp32 "
        f"({', '.join(plan.modules)}; {plan.parameters_fp32:.1%} of the parameters) meets the bar:",
        f"  {figures(plan.fidelity)}",
        "  The server searches again at load (within --mixed-search-seconds) and serves that plan, else fp32.",
    ]

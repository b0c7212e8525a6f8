"""A version's precision record: what its half precision measured against fp32, and under what conditions.

``halfserve import`` measures the version and writes ``<version>/precision.json``. A load reads it back: where the
record was measured under the same conditions as the load (torch and halfserve versions, device kind, precision,
fidelity bar, the version's files and the code that builds its model: :mod:`halfserve.codedigest`), the load trusts
its figures instead of measuring again, so a start is as fast as a store allows; where any differs, or the file is
missing, unreadable or too large, the load measures as it always has and says why. The load never writes the file
(the store may be read-only when serving); its own record lives in memory.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from enum import Enum
from pathlib import Path
from typing import Any

import pydantic
import torch

from halfserve import codedigest, storage, store
from halfserve.fidelity import Bar, Fidelity, caveat
from halfserve.manifest import Manifest, Precision
from halfserve.precision import DeviceKind
from halfserve.version import __version__

log = logging.getLogger(__name__)

RECORD = codedigest.RECORD
MAX_RECORD_BYTES = 64 * 1024
"""A record is well under 2 KiB; a larger file is not one, and is never read whole into memory."""
FORMAT = 1


class RecordCheck(str, Enum):
    """What a load made of its version's record."""

    TRUSTED = "trusted"
    """It matched the load's conditions: its figures were taken and nothing was measured at load."""
    MEASURED = "measured"
    """The version has no record (an older store, or one imported without measuring): measured at load."""
    REMEASURED = "remeasured"
    """It was measured under other conditions (``differs`` names them): measured again at load."""
    IGNORED = "ignored"
    """It could not be read (corrupt, oversized, of another format): measured at load."""
    ALWAYS = "always_measured"
    """The server measures at every load (``--fidelity-bar measure``), whatever a record says."""


class RecordError(ValueError):
    """A record file that cannot be trusted as one."""


@dataclass(frozen=True)
class Conditions:
    """What a measurement holds under: a record is trusted by a load whose conditions are the same."""

    precision: str
    bar: dict[str, Any]
    """:meth:`halfserve.fidelity.Bar.as_dict` of the bar it is held to."""
    torch: str
    device: dict[str, Any]
    """:meth:`halfserve.precision.DeviceKind.as_dict` of the device it runs on."""
    files_digest: str
    """sha256 over the version's files and the manifest fields that change what it computes
    (:func:`halfserve.codedigest.files_digest`)."""
    code: str | None = field(default=None, kw_only=True)
    """:func:`halfserve.codedigest.of` the architecture: the code that builds the model. ``None`` (a record written
    before records held it, or code too large to digest) matches nothing, so such a record is measured again."""
    halfserve: str | None = field(default=None, kw_only=True)
    """The halfserve version that measured it (its own models' code, its casts and its measures)."""

    def differs(self, other: Conditions) -> list[str]:
        """The names of the conditions in which ``other`` is not this."""
        return [
            name
            for name, _ in _NAMED
            if getattr(self, name) != getattr(other, name) or (name == "code" and self.code is None)
        ]


_NAMED = [
    ("precision", "precision"),
    ("bar", "fidelity bar"),
    ("torch", "torch version"),
    ("device", "device kind"),
    ("files_digest", "version's files"),
    ("code", "architecture's code"),
    ("halfserve", "halfserve version"),
]


@dataclass(frozen=True)
class PrecisionRecord(Conditions):
    """One measurement of a version's half precision against fp32, and the conditions it holds under."""

    fidelity: Fidelity
    """The figures, with their samples' count and source (calibration or random)."""
    measured_at: str
    """ISO 8601, UTC."""
    fp32_modules: list[str] = field(default_factory=list)
    """The modules kept in fp32 by a mixed-precision plan; empty: every module runs in ``precision``."""
    format: int = FORMAT

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def conditions(self) -> Conditions:
        return Conditions(
            self.precision,
            self.bar,
            self.torch,
            self.device,
            self.files_digest,
            code=self.code,
            halfserve=self.halfserve,
        )


_ADAPTER = pydantic.TypeAdapter(PrecisionRecord)


def path(version_dir: Path) -> Path:
    return version_dir / RECORD


def conditions(
    version_dir: Path, manifest: Manifest, precision: Precision, held_to: Bar, device: DeviceKind
) -> Conditions:
    """The conditions a measurement of the version in ``version_dir`` runs under here and now."""
    return Conditions(
        precision=Precision(precision).value,
        bar=held_to.as_dict(),
        torch=torch.__version__,
        device=device.as_dict(),
        files_digest=codedigest.files_digest(version_dir, manifest),
        code=codedigest.of(manifest.architecture),
        halfserve=__version__,
    )


def measured(under: Conditions, figures: Fidelity) -> PrecisionRecord:
    """The record of ``figures``, just measured ``under`` those conditions."""
    return PrecisionRecord(
        **asdict(under), fidelity=figures, measured_at=datetime.now(UTC).isoformat(timespec="seconds")
    )


@dataclass(frozen=True)
class AtLoad:
    """What a load made of its version's record, as ``/models`` shows it under ``precision_record``."""

    check: RecordCheck
    under: Conditions
    stored: PrecisionRecord | None = None
    """The version's record, where it has a readable one."""
    differs: list[str] = field(default_factory=list)
    """The conditions in which the stored record is not the load's (``REMEASURED``)."""
    problem: str | None = None
    """Why the stored file was ignored (``IGNORED``)."""

    @property
    def trusted(self) -> PrecisionRecord | None:
        return self.stored if self.check is RecordCheck.TRUSTED else None

    def why(self) -> str:
        """Why the load measures (or not), for its log line."""
        if self.check is RecordCheck.TRUSTED:
            return f"its {RECORD} matches this load (measured {self.stored and self.stored.measured_at}), so trusted"
        if self.check is RecordCheck.REMEASURED:
            said = f"its {RECORD} was measured with another " + ", ".join(_label(n) for n in self.differs)
            if self.under.code is None:
                said += " (this load cannot digest the architecture's code, so no record of it is trusted)"
            return said
        if self.check is RecordCheck.IGNORED:
            return f"its {RECORD} was ignored: {self.problem}"
        if self.check is RecordCheck.ALWAYS:
            return "every load measures (--fidelity-bar measure)"
        return f"it has no {RECORD}"

    def shown(self, own: PrecisionRecord | None, plan: Sequence[str] | None = None) -> dict[str, Any]:
        """``/models``' ``precision_record``: the check and the record the model is served under (the stored one where
        trusted, else the load's own, kept in memory only), with ``plan`` as its ``fp32_modules`` where the load serves
        a mixed-precision plan (found at load, or the stored one measured again), and what its figures leave open where
        they were measured on random samples (:func:`halfserve.fidelity.caveat`)."""
        served = self.trusted or own
        if served is not None and plan is not None:
            served = replace(served, fp32_modules=list(plan))
        return {
            "check": self.check.value,
            "differs": self.differs,
            "problem": self.problem,
            "record": served.as_dict() if served is not None else None,
            "caveat": caveat(served.fidelity) if served is not None else None,
        }


def _label(name: str) -> str:
    return dict(_NAMED)[name]


def at_load(version_dir: Path, under: Conditions, measure_always: bool) -> AtLoad:
    """Read and check ``version_dir``'s record against the load's conditions; an unreadable one is logged and
    ignored, never trusted."""
    try:
        stored = read(version_dir)
    except RecordError as e:
        log.warning("%s; measuring at load instead", e)
        return AtLoad(RecordCheck.IGNORED, under, problem=str(e))
    if stored is None:
        return AtLoad(RecordCheck.MEASURED, under)
    if measure_always:
        return AtLoad(RecordCheck.ALWAYS, under, stored)
    differs = stored.conditions().differs(under)
    return AtLoad(RecordCheck.REMEASURED if differs else RecordCheck.TRUSTED, under, stored, differs)


def write(version_dir: Path, record: PrecisionRecord) -> Path:
    """Write ``record`` as ``version_dir``'s record file, atomically as the store's other files are."""
    where = path(version_dir)
    store.atomic_write(where, (json.dumps(record.as_dict(), indent=2) + "\n").encode())
    return where


def read(version_dir: Path) -> PrecisionRecord | None:
    """``version_dir``'s record, or ``None`` where it has none. Raises :class:`RecordError` for a file that is not a
    record this server writes (too large, not JSON, fields missing or of the wrong type, another format)."""
    where = path(version_dir)
    try:
        size = storage.regular_file(where).st_size
        if size > MAX_RECORD_BYTES:
            raise RecordError(f"{where}: {size} bytes, over the {MAX_RECORD_BYTES}-byte limit on a precision record")
        raw = storage.read_json(where)
    except FileNotFoundError:
        return None
    except storage.StoreError as e:
        raise RecordError(str(e)) from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise RecordError(f"{where}: not a precision record of format {FORMAT}")
    try:
        return _ADAPTER.validate_python(raw)
    except pydantic.ValidationError as e:
        raise RecordError(
            f"{where}: not a valid precision record: {e.error_count()} field(s) wrong, first {_where(e)}"
        ) from None


def _where(e: pydantic.ValidationError) -> str:
    first = e.errors()[0]
    return f"{'.'.join(str(part) for part in first['loc']) or 'the record'}: {first['msg']}"

"""A sweep written out: ``loadtest.json`` (everything), ``loadtest.md`` (the table), ``loadtest.png`` (the plot),
and the same table and ratios on the terminal."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from halfserve.loadtest.runner import Sweep
from halfserve.loadtest.stats import CLIENT_BOUND_CPU, CLIENT_BOUND_SHARE, LevelResult

JSON_NAME = "loadtest.json"
TABLE_NAME = "loadtest.md"
PLOT_NAME = "loadtest.png"

NOTES = [
    "requests = successes + errors; errors are counted by HTTP status (errors_by_status) and, for transport "
    "failures, by exception type (errors_by_exception)",
    "latency percentiles (nearest rank) are over successful requests, from sending to having read the response",
    "rows = successes x rows_per_request; req_per_s and rows_per_s divide by the level's wall time",
    "mean_batch_size is the server's own count over the level: rows / batches from GET /models/{model}/stats",
    "throughput_vs_fp32 and throughput_ratio compare rows/s with fp32's at the same concurrency",
    f"client_bound: the client used >= {CLIENT_BOUND_CPU:.0%} of a core per process, or reached "
    f">= {CLIENT_BOUND_SHARE:.0%} of its own ceiling (GET /health at the top concurrency); such a level measures "
    "the client, not the server",
    "client and server CPU percentages are of one core (200% = two cores busy)",
]


def to_json(sweep: Sweep) -> dict[str, Any]:
    cfg = sweep.config
    sig = sweep.signature
    return {
        "tool": "halfserve loadtest",
        "started_at": sweep.started_at,
        "seconds": round(sweep.seconds, 2),
        "mode": "url" if cfg.url is not None else "self-contained",
        "url": cfg.url,
        "store": str(cfg.store) if cfg.url is None else None,
        "model": sweep.model,
        "signature": {"name": sig.name, "datatype": sig.datatype, "shape": list(sig.shape)} if sig else None,
        "protocol": str(cfg.protocol),
        "rows_per_request": cfg.rows_per_request,
        "input": sweep.input_description,
        "concurrency": list(cfg.concurrency),
        "duration_s": cfg.duration,
        "requests_per_level": cfg.requests,
        "warmup_s": cfg.warmup,
        "timeout_s": cfg.timeout,
        "machine": sweep.machine(),
        "client_ceiling": sweep.client_ceiling.to_dict() if sweep.client_ceiling is not None else None,
        "servers": [asdict(s) for s in sweep.servers],
        "results": [r.to_dict() for r in sweep.results],
        "throughput_ratio": sweep.ratios,
        "notes": NOTES,
    }


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _errors(r: LevelResult) -> str:
    if not r.errors:
        return "0"
    parts = [f"{k}: {v}" for k, v in {**r.errors_by_status, **r.errors_by_exception}.items()]
    return f"{r.errors} ({', '.join(parts)})"


COLUMNS = [
    "precision",
    "concurrency",
    "req/s",
    "rows/s",
    "p50 ms",
    "p90 ms",
    "p99 ms",
    "max ms",
    "mean batch",
    "errors",
    "vs fp32",
    "client CPU %",
    "server CPU %",
]


COMPACT = ["precision", "concurrency", "req/s", "rows/s", "p50 ms", "p99 ms", "mean batch", "errors", "vs fp32"]
"""The columns that fit an 80-column terminal; the Markdown table and the JSON have all of them."""
COMPACT_BELOW = 140


def table_rows(results: Sequence[LevelResult]) -> list[list[str]]:
    rows = []
    for r in results:
        precision = (
            r.precision if r.served_precision in (None, r.precision) else f"{r.precision} ({r.served_precision})"
        )
        rows.append(
            [
                precision,
                str(r.concurrency),
                _num(r.req_per_s, 0),
                _num(r.rows_per_s, 0),
                _num(r.p50_ms, 2),
                _num(r.p90_ms, 2),
                _num(r.p99_ms, 2),
                _num(r.max_ms, 2),
                _num(r.mean_batch_size),
                _errors(r),
                "-" if r.throughput_vs_fp32 is None else f"{r.throughput_vs_fp32:.2f}x",
                _num(r.client_cpu_percent, 0) + (" !" if r.client_bound else ""),
                _num(r.server_cpu_percent, 0),
            ]
        )
    return rows


def headline(sweep: Sweep) -> list[str]:
    """Lines to print under the table: what was run, the client's ceiling, the half/fp32 ratios."""
    cfg = sweep.config
    lines = [
        f"{sweep.model}: {cfg.protocol}, {cfg.rows_per_request} row(s) per request, input {sweep.input_description}; "
        + (f"{cfg.duration:g} s per level" if cfg.duration is not None else f"{cfg.requests} requests per level"),
    ]
    c = sweep.client_ceiling
    if c is not None:
        lines.append(
            f"client ceiling: {c.req_per_s:,.0f} req/s on GET /health with {c.concurrency} users "
            f"({c.client_cpu_percent:.0f}% client CPU, {c.client_cpu_us_per_request or 0:.0f} us per request)"
        )
    failed = [f"{r.precision} c={r.concurrency}" for r in sweep.results if r.requests > 0 and r.successes == 0]
    if failed:
        lines.append(f"! no successful request (no latency, see errors): {', '.join(failed)}")
    if any(r.client_bound for r in sweep.results):
        lines.append("! client-bound levels: the load generator, not the server, may set these numbers")
    for name, per_level in sweep.ratios.items():
        values = ", ".join(f"c={k} {v:.2f}x" for k, v in per_level.items())
        lines.append(f"{name} throughput (rows/s): {values}")
    return lines


def markdown(sweep: Sweep) -> str:
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(row) + " |" for row in table_rows(sweep.results)]
    out.append("")
    out += [f"- {line}" for line in headline(sweep)]
    return "\n".join(out) + "\n"


def print_summary(sweep: Sweep, console: Console) -> None:
    """The table (fewer columns on a narrow terminal) and the headline lines."""
    compact = console.width < COMPACT_BELOW
    columns = COMPACT if compact else COLUMNS
    keep = [COLUMNS.index(c) for c in columns]
    table = Table(title=f"halfserve loadtest: {sweep.model}", box=box.SIMPLE if compact else box.HEAVY_HEAD)
    for col in columns:
        header = "users" if compact and col == "concurrency" else col
        if col == "precision":
            table.add_column(header, no_wrap=True, min_width=len(header))
        else:
            table.add_column(header, justify="left" if col == "errors" else "right")
    for row in table_rows(sweep.results):
        table.add_row(*(row[i] for i in keep))
    console.print(table)
    for line in headline(sweep):
        console.print(line, markup=False, highlight=False)


def plot(sweep: Sweep, path: Path) -> None:
    """Throughput and p99 latency against concurrency, one line per precision, and the half/fp32 ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if sweep.ratios else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2), constrained_layout=True)
    by_precision: dict[str, list[LevelResult]] = {}
    for r in sweep.results:
        by_precision.setdefault(r.precision, []).append(r)
    rows_label = "rows/s" if sweep.config.rows_per_request > 1 else "requests/s"
    for name, rs in by_precision.items():
        xs = [r.concurrency for r in rs]
        axes[0].plot(xs, [r.rows_per_s for r in rs], marker="o", label=name)
        p99 = [(r.concurrency, r.p99_ms) for r in rs if r.p99_ms is not None]
        (line,) = axes[1].plot([x for x, _ in p99], [y for _, y in p99], marker="o", label=name)
        # A level without one successful request has no latency: marked on the axis, not left out unseen.
        failed = [r.concurrency for r in rs if r.p99_ms is None]
        if failed:
            axes[1].plot(
                failed,
                [0.0] * len(failed),
                marker="x",
                linestyle="none",
                color=line.get_color(),
                label=f"{name}: no successful request",
            )
    ceiling = sweep.client_ceiling
    top = max((r.rows_per_s for r in sweep.results), default=0.0)
    if ceiling is not None and sweep.config.rows_per_request == 1 and ceiling.req_per_s <= 2 * top:
        axes[0].axhline(ceiling.req_per_s, color="grey", linestyle="--", linewidth=1, label="client ceiling (/health)")
    elif ceiling is not None:
        axes[0].text(
            0.02,
            0.97,
            f"client ceiling: {ceiling.req_per_s:,.0f} req/s (GET /health)",
            transform=axes[0].transAxes,
            va="top",
            fontsize=8,
            color="grey",
        )
    axes[0].set_title(f"throughput ({sweep.config.rows_per_request} row(s)/request)")
    axes[0].set_ylabel(rows_label)
    axes[0].set_ylim(bottom=0)
    axes[1].set_title("p99 latency")
    axes[1].set_ylabel("ms")
    axes[1].set_ylim(bottom=0)
    if sweep.ratios:
        ax = axes[2]
        for name, per_level in sweep.ratios.items():
            xs = [int(k) for k in per_level]
            ys = list(per_level.values())
            ax.plot(xs, ys, marker="o", label=name)
            for x, y in zip(xs, ys, strict=True):
                ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.set_title("half / fp32 throughput")
        ax.set_ylabel("ratio of rows/s")
        top = max((v for per_level in sweep.ratios.values() for v in per_level.values()), default=1.0)
        ax.set_ylim(0, max(1.25, top * 1.2))
    levels = sweep.config.concurrency
    for ax in axes:
        ax.set_xscale("log", base=2)
        # Fixed limits: an axis with nothing plotted (no level succeeded) has no data to take a log scale from.
        ax.set_xlim(min(levels) / 1.5, max(levels) * 1.5)
        ax.set_xticks(list(sweep.config.concurrency), [str(c) for c in sweep.config.concurrency])
        ax.set_xlabel("concurrency (virtual users)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{sweep.model} - {sweep.config.protocol}", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(sweep: Sweep, out: Path) -> dict[str, Path]:
    """Write the JSON, the Markdown table and the PNG into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / JSON_NAME, "table": out / TABLE_NAME, "plot": out / PLOT_NAME}
    paths["json"].write_text(json.dumps(to_json(sweep), indent=2) + "\n")
    paths["table"].write_text(markdown(sweep))
    plot(sweep, paths["plot"])
    return paths

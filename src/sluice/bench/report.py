"""Presenting benchmark results: a summary table, a JSON document and a PNG plot.

The JSON document is the record of a run (`format` names its version):

    {"format": "sluice-bench/1", "created_at": ..., "config": {...},
     "results": [<one object per offered rate, ascending>], "goodput": {...}}

The plot has two panels sharing the offered-rate axis: latency percentiles of successful
requests with the SLO as a horizontal line, and completed throughput against the ideal y = x.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from rich import box
from rich.console import Console
from rich.table import Table

from sluice.bench.stats import STATUS_KEYS, Goodput, LatencySummary, RateResult

FORMAT = "sluice-bench/1"


def default_out_path(now: dt.datetime | None = None, folder: Path = Path("benchmarks/results")) -> Path:
    now = now or dt.datetime.now()
    return folder / f"{now:%Y%m%d-%H%M%S}.json"


def result_document(config: dict[str, Any], results: Sequence[RateResult], goodput: Goodput,
                    now: dt.datetime | None = None) -> dict[str, Any]:
    rows = []
    for result in results:
        row = msgspec.to_builtins(result)
        row["rejections_carry_retry_after"] = result.rejections_carry_retry_after
        rows.append(row)
    return {
        "format": FORMAT,
        "created_at": (now or dt.datetime.now(dt.UTC)).isoformat(timespec="seconds"),
        "config": config,
        "results": rows,
        "goodput": msgspec.to_builtins(goodput),
    }


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(document), indent=2) + b"\n")


def summary_tables(results: Sequence[RateResult], slo_ms: float, title: str = "sluice bench") -> list[Table]:
    """Two tables that fit an 80-column terminal: rates, latency (ms), server and generator CPU
    (in cores); then outcomes."""
    main = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
                 caption="rates in req/s, latency and lag in ms; batch: mean batch size; busy: device busy "
                         "ratio; gen cpu: cores the generator used", caption_justify="left")
    for header in ("offered", "sent", "ok", "ok %", "p50", "p95", "p99", "lag p99", "batch", "busy", "gen cpu"):
        main.add_column(header, justify="right", no_wrap=True)
    outcomes = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for header in ("offered", *STATUS_KEYS, "rej p50", "rej p99", "Retry-After"):
        outcomes.add_column(header, justify="right", no_wrap=True)
    for r in results:
        p99_style = "green" if r.latency is not None and r.latency.p99_ms <= slo_ms else "red"
        lag_style = "red" if r.is_behind_schedule else "default"
        main.add_row(
            f"{r.offered_rate_per_s:g}", f"{r.achieved_send_rate_per_s:.0f}", f"{r.completed_per_s:.0f}",
            f"{100 * r.success_rate:.1f}", _ms(r.latency, "p50_ms"), _ms(r.latency, "p95_ms"),
            f"[{p99_style}]{_ms(r.latency, 'p99_ms')}[/]", f"[{lag_style}]{_ms(r.lag, 'p99_ms')}[/]",
            _number(None if r.server is None else r.server.mean_batch_size, ".1f"),
            _number(None if r.server is None else r.server.busy_ratio, ".2f"),
            f"{r.generator_cpu_cores:.2f}",
        )
        outcomes.add_row(
            f"{r.offered_rate_per_s:g}", *(str(r.status_counts[k]) for k in STATUS_KEYS),
            _ms(r.rejection_latency, "p50_ms"), _ms(r.rejection_latency, "p99_ms"),
            {None: "-", True: "yes", False: "no"}[r.rejections_carry_retry_after],
        )
    return [main, outcomes]


def print_summary(console: Console, results: Sequence[RateResult], goodput: Goodput, title: str) -> None:
    for table in summary_tables(results, goodput.slo_ms, title):
        console.print(table)
    print_warnings(console, results)
    if goodput.offered_rate_per_s is None:
        console.print(f"goodput at p99 ≤ {goodput.slo_ms:g} ms: [red]no rate met the SLO[/]")
    else:
        console.print(f"goodput at p99 ≤ {goodput.slo_ms:g} ms and ≥ 99% success: "
                      f"[bold]{goodput.offered_rate_per_s:g} req/s offered[/] "
                      f"({goodput.completed_per_s:.0f} req/s completed)")


def print_warnings(console: Console, results: Sequence[RateResult]) -> None:
    """Say where the generator, not the server, may have shaped the numbers."""
    for r in results:
        if r.is_behind_schedule and r.lag is not None:
            console.print(f"[yellow]warning:[/] at {r.offered_rate_per_s:g}/s the generator fell behind "
                          f"schedule (lag p99 {r.lag.p99_ms:.1f} ms, max {r.lag.max_ms:.1f} ms); "
                          "this rate does not count towards goodput")
        if r.is_connection_limited:
            console.print(f"[yellow]warning:[/] at {r.offered_rate_per_s:g}/s up to {r.peak_in_flight} requests "
                          "were outstanding, over the connection cap: the excess waited in the client")


def two_panels(**subplots: Any) -> tuple[Any, Any, Any]:
    """A headless matplotlib figure with two stacked panels: (figure, top axes, bottom axes).
    matplotlib is imported here, not at module level: every `sluice` command imports this package."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, **subplots)
    return figure, top, bottom


def save_figure(figure: Any, path: Path) -> None:
    """Lay out, write as PNG (creating the folder) and release the figure."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot(path: Path, results: Sequence[RateResult], goodput: Goodput, title: str) -> None:
    """Latency percentiles and throughput against offered rate, as a PNG."""
    ordered = sorted(results, key=lambda r: r.offered_rate_per_s)
    rates = [r.offered_rate_per_s for r in ordered]
    figure, latency_ax, throughput_ax = two_panels(sharex=True, figsize=(8, 7.5))
    for key, label in (("p50_ms", "p50"), ("p95_ms", "p95"), ("p99_ms", "p99")):
        values = [getattr(r.latency, key) if r.latency is not None else float("nan") for r in ordered]
        latency_ax.plot(rates, values, "o-", label=label)
    behind = [r for r in ordered if r.is_behind_schedule and r.latency is not None]
    if behind:
        latency_ax.plot([r.offered_rate_per_s for r in behind], [r.latency.p99_ms for r in behind if r.latency],
                        "s", markersize=12, markerfacecolor="none", color="black", label="generator behind")
    latency_ax.axhline(goodput.slo_ms, color="red", linestyle="--", label=f"SLO {goodput.slo_ms:g} ms")
    latency_ax.set_ylabel("latency of successful requests (ms)")
    latency_ax.set_yscale("log")
    latency_ax.legend(loc="upper left")
    latency_ax.grid(True, which="both", alpha=0.3)
    latency_ax.set_title(title)

    throughput_ax.plot(rates, [r.completed_per_s for r in ordered], "o-", label="completed (200)")
    throughput_ax.plot(rates, [r.achieved_send_rate_per_s for r in ordered], "x:", label="sent")
    top = max(rates) * 1.05
    throughput_ax.plot([0, top], [0, top], color="grey", linewidth=0.8, label="y = x")
    if goodput.offered_rate_per_s is not None:
        throughput_ax.axvline(goodput.offered_rate_per_s, color="green", linestyle="--",
                              label=f"goodput {goodput.offered_rate_per_s:g}/s at SLO")
    throughput_ax.set_xlabel("offered rate (req/s)")
    throughput_ax.set_ylabel("throughput (req/s)")
    throughput_ax.set_xlim(0, top)
    throughput_ax.set_ylim(0, None)
    throughput_ax.legend(loc="upper left")
    throughput_ax.grid(True, alpha=0.3)

    save_figure(figure, path)


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ms(summary: LatencySummary | None, key: str) -> str:
    if summary is None:
        return "-"
    value = float(getattr(summary, key))
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"

"""Running and presenting a generative benchmark: calibrate, one run per rate, table, JSON, PNG.

The JSON document (`format` "sluice-bench-generative/1"):

    {"format": ..., "created_at": ..., "config": {...}, "calibration": {...},
     "results": [<GenRateResult per offered rate, ascending>]}

The plot has two panels over the offered rate: TTFT and TPOT (median and p99, log scale) with
the SLOs, and output tokens/s.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec
import uvloop
from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from sluice.bench import generative, report
from sluice.bench.genstats import GenRateResult, Percentiles, SloConfig, summarize_generation
from sluice.bench.loadgen import auth_headers, new_session

__all__ = ["GenBenchConfig", "bench_generative", "summary_tables"]

FORMAT = "sluice-bench-generative/1"


@dataclass(frozen=True, slots=True)
class GenBenchConfig:
    url: str
    endpoint: str  # "completions" | "chat"
    model: str
    rates_per_s: tuple[float, ...]
    duration_s: float
    """Each rate sends round(rate * duration) requests."""
    prompt_len: generative.LengthRange
    output_len: generative.LengthRange
    slo: SloConfig
    seed: int
    request_timeout_s: float
    max_connections: int
    timeout_ms: float | None = None
    api_key: str | None = None
    """Sent as a bearer token on every request; never written to the result file."""


class GenBenchError(Exception):
    """The benchmark could not start: server unreachable, model unknown, no usage to calibrate by."""


def bench_generative(config: GenBenchConfig, console: Console, out_path: Path | None,
                     plot_path: Path | None) -> Path:
    if not config.rates_per_s:
        raise GenBenchError("no rate to run")
    calibration, results = uvloop.run(_run(config, console))
    title = f"sluice bench: {config.endpoint} {config.model}, prompts {config.prompt_len}, outputs {config.output_len}"
    for table in summary_tables(results, title):
        console.print(table)
    for r in results:
        if r.num_failed:
            console.print(f"[yellow]warning:[/] at {r.offered_rate_per_s:g}/s {r.num_failed} requests failed; "
                          f"first: {r.first_error}")
    out_path = out_path or report.default_out_path()
    plot_path = plot_path or out_path.with_suffix(".png")
    document = {
        "format": FORMAT, "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "config": {**msgspec.to_builtins(config), "api_key": "(set)" if config.api_key else None,
                   "prompt_len": str(config.prompt_len), "output_len": str(config.output_len), "arrivals": "poisson"},
        "calibration": msgspec.to_builtins(calibration),
        "results": [msgspec.to_builtins(r) for r in results],
    }
    report.write_json(out_path, document)
    plot(plot_path, results, config.slo, title)
    console.print(f"wrote {out_path} and {plot_path}")
    return out_path


async def _run(config: GenBenchConfig, console: Console) -> tuple[generative.Calibration, list[GenRateResult]]:
    workload = generative.GenWorkload(config.url, config.model, config.endpoint == "chat", config.timeout_ms)
    results = []
    async with new_session(config.request_timeout_s, config.max_connections, auth_headers(config.api_key)) as session:
        try:
            calibration = await generative.calibrate(session, workload)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise GenBenchError(f"cannot reach {config.url}: {exc}") from exc
        except ValueError as exc:
            raise GenBenchError(str(exc)) from exc
        console.print(f"{workload.url}: {calibration.tokens_per_word:.2f} prompt tokens per word, "
                      f"{calibration.fixed_tokens:.1f} fixed")
        columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f}"),
                   TimeElapsedColumn())
        with Progress(*columns, console=console, refresh_per_second=4) as progress:
            for index, rate_per_s in enumerate(config.rates_per_s):
                num = max(1, round(rate_per_s * config.duration_s))
                requests = workload.requests(num, config.prompt_len, config.output_len, calibration,
                                             seed=config.seed + index)
                task_id = progress.add_task(f"{rate_per_s:g} req/s", total=num)
                samples = await generative.run_rate(session, workload, requests, rate_per_s, config.seed + index,
                                                    on_done=functools.partial(_completed, progress, task_id))
                results.append(summarize_generation(samples, rate_per_s, config.slo))
    return calibration, results


def _completed(progress: Progress, task_id: TaskID, num_done: int) -> None:
    progress.update(task_id, completed=num_done)


def summary_tables(results: Sequence[GenRateResult], title: str) -> list[Table]:
    """Two tables that fit an 80-column terminal: throughput, then latency (mean/median/p99 in ms)."""
    main = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
                 caption="rates in req/s; prompt: mean prompt tokens served (requested)", caption_justify="left")
    for header in ("offered", "ok", "sent", "req/s", "out tok/s", "total tok/s", "goodput", "prompt", "output"):
        main.add_column(header, justify="right", no_wrap=True)
    latency = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
                    caption="ms, mean / median / p99", caption_justify="left")
    for header in ("offered", "TTFT", "TPOT", "ITL", "E2E"):
        latency.add_column(header, justify="right", no_wrap=True)
    for r in results:
        main.add_row(
            f"{r.offered_rate_per_s:g}", str(r.num_completed), str(r.num_scheduled),
            f"{r.request_throughput_per_s:.2f}", f"{r.output_throughput_tok_s:.0f}",
            f"{r.total_token_throughput_tok_s:.0f}", "-" if r.goodput_per_s is None else f"{r.goodput_per_s:.2f}",
            f"{r.mean_prompt_len:.0f} ({r.mean_requested_prompt_len:.0f})", f"{r.mean_output_len:.0f}",
        )
        latency.add_row(f"{r.offered_rate_per_s:g}", _triple(r.ttft), _triple(r.tpot), _triple(r.itl), _triple(r.e2e))
    return [main, latency]


def _triple(p: Percentiles | None) -> str:
    if p is None:
        return "-"
    return "/".join(f"{v:.0f}" if v >= 10 else f"{v:.1f}" for v in (p.mean_ms, p.median_ms, p.p99_ms))


def plot(path: Path, results: Sequence[GenRateResult], slo: SloConfig, title: str) -> None:
    ordered = sorted(results, key=lambda r: r.offered_rate_per_s)
    rates = [r.offered_rate_per_s for r in ordered]
    figure, latency_ax, throughput_ax = report.two_panels(sharex=True, figsize=(8, 7.5))
    for name, limit in (("ttft", slo.ttft_ms), ("tpot", slo.tpot_ms)):
        for key, style in (("median_ms", "o-"), ("p99_ms", "s--")):
            values = [_get(getattr(r, name), key) for r in ordered]
            latency_ax.plot(rates, values, style, label=f"{name.upper()} {key.removesuffix('_ms')}")
        if limit is not None:
            latency_ax.axhline(limit, linestyle=":", color="red", label=f"{name.upper()} SLO {limit:g} ms")
    latency_ax.set_yscale("log")
    latency_ax.set_ylabel("ms")
    latency_ax.set_title(title, fontsize=9)
    latency_ax.legend(loc="upper left", fontsize=8)
    latency_ax.grid(True, which="both", alpha=0.3)
    throughput_ax.plot(rates, [r.output_throughput_tok_s for r in ordered], "o-", label="output tokens/s")
    throughput_ax.set_xlabel("offered rate (req/s)")
    throughput_ax.set_ylabel("output tokens/s")
    throughput_ax.set_ylim(0, None)
    throughput_ax.legend(loc="upper left")
    throughput_ax.grid(True, alpha=0.3)
    report.save_figure(figure, path)


def _get(p: Percentiles | None, key: str) -> float:
    return float("nan") if p is None else float(getattr(p, key))


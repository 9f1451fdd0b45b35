"""Orchestration behind `sluice bench`: one workload, one run per offered rate.

    metadata ─> workload ─> for each rate: warm-up + measure (progress bar) ─> summarize
                                   └─> table, JSON, PNG, goodput

Everything here runs inside one uvloop event loop so the generator spends its CPU on sending. The
load goes out on the generator's own connections; metadata and /metrics go through one aiohttp
session.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import uvloop
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from sluice.bench import report
from sluice.bench.loadgen import LoadConfig, LoadGenerator, auth_headers, new_session
from sluice.bench.promstats import scrape
from sluice.bench.selftest import run_self_test
from sluice.bench.stats import MAX_LAG_P99_MS, RateResult, select_goodput, summarize
from sluice.bench.workloads import (
    Endpoint,
    InputSpec,
    LengthRange,
    Workload,
    build_workload,
    input_specs_from_metadata,
)


class BenchError(Exception):
    """The benchmark could not start: server unreachable, model unknown, unusable metadata."""


@dataclass(frozen=True, slots=True)
class BenchConfig:
    url: str
    endpoint: Endpoint
    model: str
    input_len: int | LengthRange
    rates_per_s: tuple[float, ...]
    duration_s: float
    warmup_s: float
    timeout_ms: float | None
    slo_ms: float
    seed: int
    request_timeout_s: float
    max_connections: int
    max_lag_ms: float = MAX_LAG_P99_MS
    api_key: str | None = None
    """Sent as a bearer token on every request; never written to the result file."""
    metrics_key: str | None = None
    """Sent instead of `api_key` to read `/metrics` (a server whose tenants file asks for metrics keys)."""

def bench(config: BenchConfig, console: Console, out_path: Path | None, plot_path: Path | None) -> Path:
    """Run every rate, print the summary, write the JSON and the plot; returns the JSON path."""
    if not config.rates_per_s:
        raise BenchError("no rate to run")
    results, model_platform = uvloop.run(_run_rates(config, console))
    goodput = select_goodput(results, config.slo_ms)
    emulated = " (emulated device)" if model_platform == "sluice_emulated" else ""
    title = f"sluice bench: {config.endpoint.value} {config.model}{emulated}"
    report.print_summary(console, results, goodput, title)
    out_path = out_path or report.default_out_path()
    plot_path = plot_path or out_path.with_suffix(".png")
    document = report.result_document(config_document(config, model_platform), results, goodput)
    report.write_json(out_path, document)
    report.plot(plot_path, results, goodput, title)
    console.print(f"wrote {out_path} and {plot_path}")
    return out_path


def self_test(console: Console, concurrency: int, duration_s: float, rates_per_s: tuple[float, ...],
              out_path: Path | None, max_lag_ms: float = MAX_LAG_P99_MS) -> None:
    console.print(f"self-test: null server in a child process, {duration_s:g} s per measurement")
    result = uvloop.run(run_self_test(concurrency, duration_s, rates_per_s, max_lag_ms))
    closed = result.closed_loop
    console.print(f"closed loop, {closed.concurrency} connections: "
                  f"[bold]{closed.requests_per_s:.0f} req/s[/] ({closed.num_errors} errors), "
                  "the generator's ceiling on this machine now")
    console.print(f"generator CPU: {closed.cpu_us_per_request:.0f} µs per request, "
                  f"{closed.cpu_s / closed.duration_s:.2f} cores in use "
                  f"(~{1e6 / closed.cpu_us_per_request:.0f} req/s on a whole idle core)")
    if result.open_loop:
        for table in report.summary_tables(result.open_loop, slo_ms=float("inf"), title="open loop, null server"):
            console.print(table)
        report.print_warnings(console, result.open_loop)
        for r in result.open_loop:
            verdict = "[red]fell behind[/]" if r.is_behind_schedule else "[green]kept up[/]"
            console.print(f"{r.offered_rate_per_s:g} req/s: {verdict} (lag p99 "
                          f"{r.lag.p99_ms if r.lag else float('nan'):.1f} ms, limit {max_lag_ms:g} ms)")
    if out_path is not None:
        document = {"format": report.FORMAT + "-selftest", "closed_loop": msgspec.to_builtins(closed),
                    "closed_loop_requests_per_s": closed.requests_per_s,
                    "closed_loop_cpu_us_per_request": closed.cpu_us_per_request,
                    "open_loop": [msgspec.to_builtins(r) for r in result.open_loop]}
        report.write_json(out_path, document)
        console.print(f"wrote {out_path}")


def config_document(config: BenchConfig, model_platform: str | None) -> dict[str, Any]:
    document: dict[str, Any] = msgspec.to_builtins(config)
    document["input_len"] = config.input_len if isinstance(config.input_len, int) else str(config.input_len)
    document["api_key"] = "(set)" if config.api_key else None
    document["metrics_key"] = "(set)" if config.metrics_key else None
    document.update(model_platform=model_platform, is_emulated=model_platform == "sluice_emulated",
                    arrivals="poisson")
    return document


async def _run_rates(config: BenchConfig, console: Console) -> tuple[list[RateResult], str | None]:
    results: list[RateResult] = []
    async with new_session(config.request_timeout_s, config.max_connections, auth_headers(config.api_key)) as session:
        metadata = await _model_metadata(session, config)
        model_platform = None if metadata is None else metadata.get("platform")
        spec: InputSpec | tuple[InputSpec, ...] | None = None
        if config.endpoint is Endpoint.KSERVE:
            if metadata is None:
                raise BenchError(f"model {config.model!r} has no KServe metadata at {config.url}")
            try:
                spec = input_specs_from_metadata(metadata)
            except ValueError as exc:
                raise BenchError(str(exc)) from exc
        def new_workload() -> Workload:  # one per rate: no rate resends an earlier one's bodies
            return build_workload(config.endpoint, config.url, config.model, config.input_len, config.timeout_ms,
                                  spec, seed=config.seed, extra_headers=auth_headers(config.api_key))

        workload = new_workload()
        console.print(f"{workload.description} -> {workload.url}")
        snapshot = functools.partial(scrape, session, config.url, config.model,
                                     headers=auth_headers(config.metrics_key) if config.metrics_key else None)
        columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[sent]} sent"),
                   TextColumn("{task.completed:.0f}/{task.total:.0f} done"), TimeElapsedColumn())
        with Progress(*columns, console=console, refresh_per_second=4) as progress:
            for rate_per_s in config.rates_per_s:
                expected = max(1, round(rate_per_s * (config.warmup_s + config.duration_s)))
                task_id = progress.add_task(f"{rate_per_s:g} req/s", total=expected, sent=0)

                def on_progress(num_sent: int, num_done: int, task_id: Any = task_id) -> None:
                    progress.update(task_id, completed=num_done, sent=num_sent)

                load = LoadConfig(rate_per_s, config.duration_s, config.warmup_s, config.seed)
                generator = LoadGenerator(workload, config.request_timeout_s, config.max_connections)
                samples = await generator.run(load, snapshot, on_progress)
                workload = new_workload()
                progress.update(task_id, total=progress.tasks[-1].completed)  # the Poisson count, now known
                results.append(summarize(samples, config.max_lag_ms))
    return results, model_platform


async def _model_metadata(session: aiohttp.ClientSession, config: BenchConfig) -> dict[str, Any] | None:
    """The model's KServe metadata; `None` if the server answers without it (e.g. not a KServe server)."""
    url = f"{config.url}/v2/models/{config.model}"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as response:
            if response.status != 200:
                if config.endpoint is Endpoint.KSERVE:
                    text = await response.text()
                    raise BenchError(f"GET {url} answered {response.status}: {text[:200]}")
                return None
            document = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise BenchError(f"cannot reach {config.url}: {exc}") from exc
    return document if isinstance(document, dict) else None

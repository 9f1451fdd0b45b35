"""`sluice bench`: drive a running server with open-loop load and report what it sustained.

    sluice bench --rate 500 --duration 10
    sluice bench --rates 200,400,800,1200,1600 --slo-ms 100 --out sweep.json
    sluice bench --self-test --rate 2700          # how fast can this machine send?
    sluice bench --scenario noisy-neighbour       # a named multi-tenant scenario on its own server
    sluice bench --endpoint completions --model tiny-lm --rates 2,4,8 --prompt-len 32:256 --output-len 16:128
"""

from __future__ import annotations

import math
from pathlib import Path

import click

from sluice.server_url import check_server_url

# Heavy imports (numpy, aiohttp, matplotlib) happen inside the command: every `sluice` command
# imports this module.

_ENDPOINTS = ("kserve", "embeddings")
_SCENARIOS = ("overload", "noisy-neighbour", "priority-mix", "weights")  # sluice.bench.scenarios.SCENARIOS
_GENERATIVE_ENDPOINTS = ("completions", "chat")


@click.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, callback=check_server_url,
              help="Base URL of the server.")
@click.option("--api-key", envvar=["SLUICE_API_KEY", "OPENAI_API_KEY"], show_envvar=True, default=None,
              help="Sent as 'Authorization: Bearer KEY' on every request (load, metadata, /metrics), for a "
                   "server with a tenants file. Never written to the result files.")
@click.option("--metrics-key", envvar="SLUICE_METRICS_KEY", show_envvar=True, default=None,
              help="Sent instead of --api-key to read /metrics, for a server whose tenants file asks for a "
                   "metrics key there (`sluice keys create --metrics`). Never written to the result files.")
@click.option("--endpoint", type=click.Choice(_ENDPOINTS + _GENERATIVE_ENDPOINTS), default="kserve", show_default=True,
              help="completions/chat: streaming generation (SSE), reported with vLLM's TTFT/TPOT/ITL metrics.")
@click.option("--model", default="emulated", show_default=True)
@click.option("--input-len", default="16", show_default=True,
              help="Length of a tensor input's variable dimension: N, or LOW:HIGH drawn per body.")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Offered load in requests per second (Poisson arrivals).")
@click.option("--rates", default=None, help="A sweep: comma-separated rates, e.g. 200,400,800.")
@click.option("--duration", "duration_s", type=click.FloatRange(min=0, min_open=True), default=10.0,
              show_default=True, help="Measured seconds per rate.")
@click.option("--warmup", "warmup_s", type=click.FloatRange(min=0), default=2.0, show_default=True,
              help="Seconds at each rate before measuring.")
@click.option("--timeout-ms", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Send X-Request-Timeout-Ms (the server's deadline for each request).")
@click.option("--slo-ms", type=click.FloatRange(min=0, min_open=True), default=100.0, show_default=True,
              help="p99 latency target for goodput.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="JSON result file (default: benchmarks/results/<timestamp>.json).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="PNG plot (default: next to the JSON file).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the arrival process.")
@click.option("--request-timeout-s", type=click.FloatRange(min=0, min_open=True), default=30.0,
              show_default=True, help="Client-side limit per request; a request over it counts as an error.")
@click.option("--max-connections", type=click.IntRange(0), default=1000, show_default=True,
              help="Cap on open connections (0: none). Requests over the cap wait in the client, "
                   "and the run is reported as connection-limited.")
@click.option("--max-lag-ms", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="A rate whose p99 send lag is over this is reported as behind schedule and "
                   "does not count towards goodput.")
@click.option("--self-test", is_flag=True,
              help="Measure the generator itself against a null server: closed-loop maximum, and "
                   "open-loop at --rate/--rates if given.")
@click.option("--concurrency", type=click.IntRange(1), default=64, show_default=True,
              help="Connections for the --self-test closed loop.")
@click.option("--scenario", type=click.Choice(_SCENARIOS), default=None,
              help="Run a named multi-tenant scenario on a server it starts itself (ignores --url, "
                   "--endpoint, --model, --rate/--rates); see benchmarks/README.md.")
@click.option("--scale", type=click.FloatRange(min=0, min_open=True), default=3.0, show_default=True,
              help="For --scenario: the emulated device's slow-down against the demo model "
                   "(alpha, beta and the SLO times this).")
@click.option("--prompt-len", default="32:256", show_default=True,
              help="completions/chat: prompt tokens, a number or a uniform low:high range.")
@click.option("--output-len", default="16:128", show_default=True,
              help="completions/chat: output tokens (max_tokens with ignore_eos), a number or low:high.")
@click.option("--ttft-slo-ms", type=click.FloatRange(min=0, min_open=True), default=None,
              help="completions/chat: TTFT target for goodput.")
@click.option("--tpot-slo-ms", type=click.FloatRange(min=0, min_open=True), default=None,
              help="completions/chat: TPOT target for goodput.")
def bench(url: str, api_key: str | None, metrics_key: str | None, endpoint: str, model: str, input_len: str,
          rate: float | None, rates: str | None, duration_s: float, warmup_s: float, timeout_ms: float | None,
          slo_ms: float, out_path: Path | None, plot_path: Path | None, seed: int, request_timeout_s: float,
          max_connections: int, max_lag_ms: float, self_test: bool, concurrency: int, scenario: str | None,
          scale: float, prompt_len: str, output_len: str, ttft_slo_ms: float | None,
          tpot_slo_ms: float | None) -> None:
    """Open-loop load generator: offer Poisson load to a running server and report what it sustained.

    For completions/chat each rate sends round(rate * duration) streamed requests (no warm-up).
    """
    from rich.console import Console

    console = Console()
    if scenario is not None:
        from sluice.bench import scenario_run
        from sluice.bench.scenarios import SCENARIOS

        config = scenario_run.ScenarioConfig(SCENARIOS[scenario], scenario_run.Device(scale), duration_s, warmup_s,
                                             seed, max_connections)
        try:
            scenario_run.run(config, console, out_path, plot_path)
        except scenario_run.ScenarioError as exc:
            raise click.ClickException(str(exc)) from exc
        return
    rates_per_s = _parse_rates(rate, rates, required=not self_test)
    if endpoint in _GENERATIVE_ENDPOINTS:
        _bench_generative(url, endpoint, model, rates_per_s, duration_s, prompt_len, output_len, ttft_slo_ms,
                          tpot_slo_ms, seed, request_timeout_s, max_connections, timeout_ms, out_path, plot_path,
                          api_key)
        return

    from sluice.bench import runner
    from sluice.bench.workloads import Endpoint, parse_length

    if self_test:
        runner.self_test(console, concurrency, duration_s, rates_per_s, out_path, max_lag_ms)
        return
    try:
        lengths = parse_length(input_len)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--input-len") from exc
    length = lengths.low if lengths.low == lengths.high else lengths
    bench_config = runner.BenchConfig(url.rstrip("/"), Endpoint(endpoint), model, length, rates_per_s,
                                      duration_s, warmup_s, timeout_ms, slo_ms, seed, request_timeout_s,
                                      max_connections, max_lag_ms, api_key, metrics_key)
    try:
        runner.bench(bench_config, console, out_path, plot_path)
    except runner.BenchError as exc:
        raise click.ClickException(str(exc)) from exc


def _bench_generative(url: str, endpoint: str, model: str, rates_per_s: tuple[float, ...], duration_s: float,
                      prompt_len: str, output_len: str, ttft_slo_ms: float | None, tpot_slo_ms: float | None,
                      seed: int, request_timeout_s: float, max_connections: int, timeout_ms: float | None,
                      out_path: Path | None, plot_path: Path | None, api_key: str | None) -> None:
    from rich.console import Console

    from sluice.bench import genreport
    from sluice.bench.generative import parse_length
    from sluice.bench.genstats import SloConfig

    try:
        prompt, output = parse_length(prompt_len), parse_length(output_len)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    config = genreport.GenBenchConfig(url.rstrip("/"), endpoint, model, rates_per_s, duration_s, prompt, output,
                                      SloConfig(ttft_slo_ms, tpot_slo_ms), seed, request_timeout_s,
                                      max_connections, timeout_ms, api_key)
    try:
        genreport.bench_generative(config, Console(), out_path, plot_path)
    except genreport.GenBenchError as exc:
        raise click.ClickException(str(exc)) from exc


def _parse_rates(rate: float | None, rates: str | None, required: bool) -> tuple[float, ...]:
    if rate is not None and rates is not None:
        raise click.UsageError("give --rate or --rates, not both")
    if rate is not None:
        return (rate,)
    if rates is None:
        if required:
            raise click.UsageError("give --rate R or --rates R1,R2,...")
        return ()
    try:
        parsed = sorted({float(part) for part in rates.split(",") if part.strip()})
    except ValueError:
        raise click.BadParameter(f"not a comma-separated list of numbers: {rates!r}",
                                 param_hint="--rates") from None
    if not parsed or any(not math.isfinite(r) or r <= 0 for r in parsed):
        raise click.BadParameter(f"rates must be positive numbers: {rates!r}", param_hint="--rates")
    return tuple(parsed)


__all__ = ["bench"]

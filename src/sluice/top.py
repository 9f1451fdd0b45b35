"""`sluice top`: what a running server is doing, live, read from its Prometheus `/metrics`.

Each refresh compares two scrapes `interval` seconds apart (counters: their increase over the
interval, as Prometheus' `rate()`; a counter that went down was reset by a restart and counts
from zero):

    models      the version's share of the model's unversioned traffic (its split or canary, now);
                answers per second by outcome; p50 / p99 of the successful ones' latency (from the
                `sluice_request_duration_seconds` buckets, interpolated as `histogram_quantile`);
                batches per second, their mean size (Δ sum / Δ count of `sluice_batch_size`) and
                mean device time; what is queued now; the result cache's hit rate
    generation  sequences running and waiting, KV cache in use (now); prompt and output tokens per
                second, TTFT p50 / p99, TPOT p50, prefix-cache hit rate, preemptions
    tenants     admitted, completed within deadline, refused (by reason) per second, and each
                tenant's share of the device time used in the interval
    workers     ready; each one's device busy over the interval

Parsing (`sluice.exposition`) and arithmetic (`view`) are pure, `render` lays a `View` out with rich,
and `fetch`, `watch`, `print_once` and `watch_live` do the I/O.
"""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from sluice.exposition import Scrape, histogram_quantile


class TopError(Exception):
    """The server could not be read (unreachable, refused the key, not a sluice server)."""

    def __init__(self, message: str, *, is_refusal: bool = False) -> None:
        super().__init__(message)
        self.is_refusal = is_refusal
        """The server refused the key (401/403): reading again cannot help."""


def _increase(before: float, after: float) -> float:
    return after - before if after >= before else after  # a counter that went down restarted from 0


class _Interval:
    """Two scrapes: what each counter did between them."""

    def __init__(self, before: Scrape, after: Scrape) -> None:
        self.before, self.after = before, after
        self.seconds = max(after.taken_at_s - before.taken_at_s, 1e-9)

    def increase(self, name: str, keys: tuple[str, ...], **match: str) -> dict[tuple[str, ...], float]:
        old = self.before.grouped(name, keys, **match)
        return {key: _increase(old.get(key, 0.0), value)
                for key, value in self.after.grouped(name, keys, **match).items()}

    def rate(self, name: str, keys: tuple[str, ...], **match: str) -> dict[tuple[str, ...], float]:
        return {key: value / self.seconds for key, value in self.increase(name, keys, **match).items()}

    def ratio(self, numerator: str, denominator: str, keys: tuple[str, ...]) -> dict[tuple[str, ...], float | None]:
        """Δ numerator / Δ denominator per key; None where the denominator did not move."""
        top, bottom = self.increase(numerator, keys), self.increase(denominator, keys)
        return {key: top.get(key, 0.0) / count if count > 0 else None for key, count in bottom.items()}

    def quantiles(self, histogram: str, keys: tuple[str, ...], qs: tuple[float, ...],
                  **match: str) -> dict[tuple[str, ...], tuple[float | None, ...]]:
        """Each key's quantiles `qs` of the observations made in the interval."""
        buckets: dict[tuple[str, ...], dict[float, float]] = defaultdict(dict)
        for key, count in self.increase(f"{histogram}_bucket", (*keys, "le"), **match).items():
            buckets[key[:-1]][float(key[-1])] = count
        return {key: tuple(histogram_quantile(q, counts) for q in qs) for key, counts in buckets.items()}


# ---- the view ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelRow:
    model: str
    version: str
    ok_per_s: float
    refused_per_s: float
    """503: refused for overload."""
    expired_per_s: float
    """504: its deadline could not be met."""
    failed_per_s: float
    """Failed on a device or worker, or no worker could take it."""
    invalid_per_s: float
    """The client's input was refused (4xx)."""
    p50_ms: float | None
    p99_ms: float | None
    batches_per_s: float | None
    """None (also `queued` and `queued_work_ms`): the server exports no worker's series (a
    cluster's gateway: each worker has them on its own `--metrics-port`)."""
    mean_batch: float | None
    batch_ms: float | None
    queued: float | None
    queued_work_ms: float | None
    cache_hit: float | None
    traffic_share: float | None = None
    """The share of the model's requests that name no version that go to this one (its split or canary)."""


@dataclass(frozen=True, slots=True)
class GenerationRow:
    model: str
    running: float
    waiting: float
    kv_cache_used: float | None
    prompt_tokens_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    prefix_hit: float | None
    preemptions_per_s: float


@dataclass(frozen=True, slots=True)
class TenantRow:
    tenant: str
    priority_class: str
    admitted_per_s: float
    goodput_per_s: float
    refused_per_s: dict[str, float]
    """Refused before admission, by reason: requests, tokens, concurrency, credits, overloaded, expired
    (an admitted request that ends otherwise is in the models table, not here)."""
    device_share: float | None


@dataclass(frozen=True, slots=True)
class View:
    seconds: float
    workers_ready: float | None
    busy_by_worker: dict[str, float]
    models: list[ModelRow] = field(default_factory=list)
    generation: list[GenerationRow] = field(default_factory=list)
    tenants: list[TenantRow] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


_FAILED = ("failed", "unavailable", "error")


def view(before: Scrape, after: Scrape) -> View:
    """What the server did between two scrapes of its `/metrics`."""
    span = _Interval(before, after)
    ready = after.grouped("sluice_workers_ready", ())
    return View(
        seconds=span.seconds,
        workers_ready=ready.get((), None),
        busy_by_worker={worker: min(rate, 1.0) for (worker,), rate
                        in sorted(span.rate("sluice_device_busy_seconds_total", ("worker",)).items())},
        models=_models(span),
        generation=_generation(span),
        tenants=_tenants(span),
    )


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def _models(span: _Interval) -> list[ModelRow]:
    keys = ("model", "version")
    answers = span.rate("sluice_requests_total", (*keys, "outcome"))
    latency = span.quantiles("sluice_request_duration_seconds", keys, (0.5, 0.99), outcome="ok")
    batches = span.rate("sluice_batch_size_count", keys)
    mean_batch = span.ratio("sluice_batch_size_sum", "sluice_batch_size_count", keys)
    batch_s = span.ratio("sluice_batch_execution_seconds_sum", "sluice_batch_execution_seconds_count", keys)
    queued = span.after.grouped("sluice_queue_depth", keys)
    queued_s = span.after.grouped("sluice_queued_work_seconds", keys)
    lookups = span.increase("sluice_cache_lookups_total", ("model", "result"))
    shares = span.after.grouped("sluice_traffic_share", keys)
    has_workers = _has_worker_series(span.after)
    rows = []
    for key in sorted({key[:2] for key in answers} | set(batches) | set(queued)):
        model, version = key
        served = sum(n for (name, _), n in lookups.items() if name == model)
        p50, p99 = latency.get(key, (None, None))
        rows.append(ModelRow(
            model, version, _answered(answers, key, "ok"), _answered(answers, key, "rejected"),
            _answered(answers, key, "expired"), _answered(answers, key, *_FAILED), _answered(answers, key, "invalid"),
            _ms(p50), _ms(p99), batches.get(key, 0.0) if has_workers else None, mean_batch.get(key),
            _ms(batch_s.get(key)), queued.get(key, 0.0) if has_workers else None,
            queued_s.get(key, 0.0) * 1000 if has_workers else None,
            lookups.get((model, "hit"), 0.0) / served if served > 0 else None, shares.get(key),
        ))
    return rows


def _has_worker_series(scrape: Scrape) -> bool:
    """The scrape has what workers export (`sluice serve`'s gateway merges its workers' series; a
    cluster's gateway does not)."""
    return any(name in scrape.samples for name in ("sluice_queue_depth", "sluice_batch_size_count",
                                                   "sluice_device_busy_seconds_total"))


def _answered(rates: dict[tuple[str, ...], float], key: tuple[str, ...], *outcomes: str) -> float:
    return sum(rates.get((*key, outcome), 0.0) for outcome in outcomes)


def _generation(span: _Interval) -> list[GenerationRow]:
    model = ("model",)
    running = span.after.grouped("vllm:num_requests_running", ("model_name",))
    waiting = span.after.grouped("vllm:num_requests_waiting", ("model_name",))
    kv = span.after.grouped("vllm:kv_cache_usage_perc", ("model_name",))
    prompt = span.rate("sluice_prompt_tokens_total", model)
    output = span.rate("sluice_generation_tokens_total", model)
    ttft = span.quantiles("sluice_time_to_first_token_seconds", model, (0.5, 0.99))
    tpot = span.quantiles("sluice_time_per_output_token_seconds", model, (0.5,))
    prefix_hit = span.ratio("sluice_prefix_cache_hits_total", "sluice_prefix_cache_queries_total", model)
    preemptions = span.rate("sluice_preemptions_total", model)
    rows = []
    for key in sorted(set(running) | set(waiting) | set(output)):
        ttft_p50, ttft_p99 = ttft.get(key, (None, None))
        rows.append(GenerationRow(
            key[0], running.get(key, 0.0), waiting.get(key, 0.0), kv.get(key), prompt.get(key, 0.0),
            output.get(key, 0.0), _ms(ttft_p50), _ms(ttft_p99), _ms(tpot.get(key, (None,))[0]),
            prefix_hit.get(key), preemptions.get(key, 0.0),
        ))
    return rows


def _tenants(span: _Interval) -> list[TenantRow]:
    keys = ("tenant", "class")
    admitted = span.rate("sluice_tenant_admitted_total", keys)
    goodput = span.rate("sluice_tenant_goodput_total", keys)
    refused = span.rate("sluice_tenant_rejected_total", (*keys, "reason"))
    device = span.increase("sluice_tenant_device_seconds_total", keys)
    total_device_s = sum(device.values())
    rows = []
    for tenant, priority_class in sorted(set(admitted) | {key[:2] for key in refused}):
        reasons = {reason: rate for (t, c, reason), rate in refused.items()
                   if (t, c) == (tenant, priority_class) and rate > 0}
        share = device.get((tenant, priority_class), 0.0) / total_device_s if total_device_s > 0 else None
        rows.append(TenantRow(tenant, priority_class, admitted.get((tenant, priority_class), 0.0),
                              goodput.get((tenant, priority_class), 0.0), reasons, share))
    return rows


# ---- rendering --------------------------------------------------------------------------------


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def _table(title: str, columns: Iterable[str], rows: Iterable[Iterable[str]]) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold", box=None, pad_edge=False)
    for index, column in enumerate(columns):
        table.add_column(column, justify="left" if index == 0 else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


def render(url: str, current: View) -> RenderableType:
    """`current` as a few tables (the models', then generation's and tenants' when there are any)."""
    busy = "  ".join(f"{worker}: {_percent(ratio)}" for worker, ratio in current.busy_by_worker.items())
    ready = "-" if current.workers_ready is None else f"{current.workers_ready:.0f}"
    parts: list[RenderableType] = [
        Text(f"{url}  ·  over the last {current.seconds:.1f} s  ·  workers ready: {ready}"
             + (f"  ·  device busy {busy}" if busy else "")),
        _table("models", ["model", "traffic", "ok\n/s", "refused\n/s", "expired\n/s", "failed\n/s", "invalid\n/s",
                          "p50\nms", "p99\nms", "batches\n/s", "mean\nbatch", "batch\nms", "queued", "queued\nms",
                          "cache\nhits"],
               ([f"{m.model} v{m.version}", _percent(m.traffic_share), _number(m.ok_per_s), _number(m.refused_per_s),
                 _number(m.expired_per_s), _number(m.failed_per_s), _number(m.invalid_per_s), _number(m.p50_ms),
                 _number(m.p99_ms), _number(m.batches_per_s), _number(m.mean_batch), _number(m.batch_ms),
                 _number(m.queued, 0), _number(m.queued_work_ms), _percent(m.cache_hit)] for m in current.models)),
    ]
    if current.models and all(m.batches_per_s is None for m in current.models):
        parts.append(Text("no worker series here (a cluster's gateway): batches, queues and devices are on each "
                          "worker's --metrics-port, which `sluice top --url` reads too"))
    if current.generation:
        parts.append(_table(
            "generation", ["model", "running", "waiting", "KV\ncache", "prompt\ntok/s", "output\ntok/s",
                           "TTFT p50\nms", "TTFT p99\nms", "TPOT p50\nms", "prefix\nhits", "preempted\n/s"],
            ([g.model, _number(g.running, 0), _number(g.waiting, 0), _percent(g.kv_cache_used),
              _number(g.prompt_tokens_per_s), _number(g.output_tokens_per_s), _number(g.ttft_p50_ms),
              _number(g.ttft_p99_ms), _number(g.tpot_p50_ms), _percent(g.prefix_hit),
              _number(g.preemptions_per_s)] for g in current.generation)))
    if current.tenants:
        parts.append(_table(
            "tenants", ["tenant", "class", "admitted\n/s", "within\ndeadline/s", "refused\n/s", "device\nshare"],
            ([t.tenant, t.priority_class, _number(t.admitted_per_s), _number(t.goodput_per_s),
              _refusals(t.refused_per_s), _percent(t.device_share)] for t in current.tenants)))
    return Group(*parts)


def _refusals(by_reason: dict[str, float]) -> str:
    if not by_reason:
        return "0.0"
    total = sum(by_reason.values())
    reasons = ", ".join(f"{reason} {rate:,.1f}" for reason, rate in sorted(by_reason.items(), key=lambda kv: -kv[1]))
    return f"{total:,.1f} ({reasons})"


# ---- I/O ---------------------------------------------------------------------------------------


def fetch(url: str, key: str | None, tls: ssl.SSLContext | None = None, timeout_s: float = 10.0) -> Scrape:
    """One scrape of `url`'s `/metrics`, timed on `time.monotonic()`; `tls`: how to check an
    https server's certificate (by default, against the system's CAs)."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(url.rstrip("/") + "/metrics", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=tls) as answer:
            text = answer.read().decode()
    except urllib.error.HTTPError as exc:
        refused = exc.code in (401, 403)
        hint = " (pass a metrics or admin key with --key)" if refused else ""
        raise TopError(f"{url}/metrics answered {exc.code} {exc.reason}{hint}", is_refusal=refused) from None
    except (urllib.error.URLError, OSError) as exc:
        raise TopError(f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from None
    except ValueError as exc:  # a URL that cannot be sent
        raise TopError(f"cannot read {url}/metrics: {exc}") from None
    taken_at_s = time.monotonic()
    try:
        return Scrape.parse(text, taken_at_s)
    except ValueError as exc:
        raise TopError(f"{url}/metrics is not a Prometheus exposition: {exc}") from None


def print_once(url: str, key: str | None, interval_s: float, tls: ssl.SSLContext | None = None, *,
               as_json: bool = False) -> None:
    """One view (two scrapes `interval_s` apart) on stdout, as tables or JSON; `TopError` if the
    server could not be read."""
    current = next(watch(url, key, interval_s, tls))
    if isinstance(current, TopError):
        raise current
    if as_json:
        print(json.dumps(current.as_json(), indent=2))
        return
    console = Console()
    if not console.is_terminal:  # a file or a pipe: no terminal's width to fit, keep columns whole
        console.width = 200
    console.print(render(url, current))


def watch_live(url: str, key: str | None, interval_s: float, tls: ssl.SSLContext | None = None) -> None:
    """A view every `interval_s`, redrawn in place until interrupted. `TopError` if the first
    scrape fails (a server that is not there, a wrong URL or key: nothing to wait for), or if one
    is refused for its key; any other error after a good scrape is shown, and reading goes on (a
    server restarting)."""
    with Live(f"reading {url}/metrics every {interval_s:g} s ...", auto_refresh=False) as live:
        try:
            for num_read, current in enumerate(watch(url, key, interval_s, tls)):
                if isinstance(current, TopError) and (num_read == 0 or current.is_refusal):
                    raise current
                live.update(f"{current} (retrying)" if isinstance(current, TopError) else render(url, current),
                            refresh=True)
        except KeyboardInterrupt:
            pass


def watch(url: str, key: str | None, interval_s: float, tls: ssl.SSLContext | None = None) -> Iterator[View | TopError]:
    """A view every `interval_s` (the first after two scrapes), or the error that stopped one;
    after an error, the next view starts from the next good scrape."""
    before: Scrape | None = None
    while True:
        started = time.monotonic()
        try:
            after = fetch(url, key, tls)
        except TopError as exc:
            before = None
            yield exc
        else:
            if before is not None:
                yield view(before, after)
            before = after
        time.sleep(max(interval_s - (time.monotonic() - started), 0.0))

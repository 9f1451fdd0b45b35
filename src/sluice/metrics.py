"""Every Prometheus metric sluice exports, declared once, with bounded labels.

Components never create metrics; they receive a recorder (`GatewayMetrics`, `WorkerMetrics`).
In the embedded server, gateway and workers are separate processes that share one
`PROMETHEUS_MULTIPROC_DIR` (set by the CLI before this module is imported), so the gateway's
`/metrics` shows the workers' series too.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import multiprocess as _multiprocess

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2,
                    0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""From a queue wait or an emulated batch well under a millisecond to a generation (or a batch-class
item's wait) of minutes: beyond the last bound a percentile reads as that bound, whatever it was."""
_BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)

REQUESTS = Counter(
    "sluice_requests",
    "Requests answered, by outcome: ok, rejected (overload), expired (deadline), invalid (the client's input), "
    "failed (device or worker failure), unavailable, cancelled (the client went away), error (an internal "
    "error: 500).",
    ["model", "version", "outcome"],
)
EXPIRED = Counter(
    "sluice_expired_requests",
    "Requests answered 504 (outcome expired), by whose deadline they missed: slo (the model's SLO set it) or "
    "client (the client's own timeout, which may simply be too short).",
    ["model", "version", "deadline"],
)
REQUEST_DURATION = Histogram(
    "sluice_request_duration_seconds", "Time from admission at the gateway to the answer.",
    ["model", "version", "outcome"], buckets=_LATENCY_BUCKETS,
)
QUEUE_WAIT = Histogram(
    "sluice_queue_wait_seconds", "Time items waited in the worker's queue before their batch started.",
    ["model", "version"], buckets=_LATENCY_BUCKETS,
)
EXECUTION = Histogram(
    "sluice_batch_execution_seconds", "Device time of one batch.",
    ["model", "version"], buckets=_LATENCY_BUCKETS,
)
BATCH_SIZE = Histogram(
    "sluice_batch_size", "Items per executed batch.", ["model", "version"], buckets=_BATCH_BUCKETS,
)
DEVICE_BUSY = Counter(
    "sluice_device_busy_seconds", "Seconds the device spent executing batches and generative engine steps.", ["worker"],
)
REFUSED_WORK = Counter(
    "sluice_refused_work_seconds",
    "Predicted device-seconds of requests refused for overload: the demand the devices did not serve. "
    "rate(sluice_device_busy_seconds_total) + rate(this) is the number of devices the offered load needs.",
    ["model", "version"],
)
DEVICE_BUSY_RATIO = Gauge(
    "sluice_device_busy_ratio", "Fraction of the last few seconds the device was busy.", ["worker"],
    multiprocess_mode="liveall",
)
QUEUE_DEPTH = Gauge(
    "sluice_queue_depth", "Items queued on workers.", ["model", "version"], multiprocess_mode="livesum",
)
QUEUED_WORK = Gauge(
    "sluice_queued_work_seconds", "Predicted device-seconds of queued work.", ["model", "version"],
    multiprocess_mode="livesum",
)
PROFILE_ALPHA = Gauge(
    "sluice_latency_profile_alpha_seconds", "Learned fixed cost of a batch.", ["model", "version", "worker"],
    multiprocess_mode="liveall",
)
PROFILE_BETA = Gauge(
    "sluice_latency_profile_beta_seconds", "Learned cost per unit of padded batch cost.",
    ["model", "version", "worker"], multiprocess_mode="liveall",
)
LOG_LINES_DROPPED = Counter(
    "sluice_log_lines_dropped",
    "Log lines (access log included) dropped because stderr was not read fast enough (`sluice.logs`), by "
    "process: gateway or worker-ID.", ["process"],
)
ITEM_FAILURES = Counter("sluice_item_failures", "Items that failed inside the model.", ["model", "version"])
WORKERS_READY = Gauge("sluice_workers_ready", "Workers connected and ready.", multiprocess_mode="livemax")
WORKER_RESTARTS = Counter("sluice_worker_restarts", "Worker processes restarted after an exit.")
REDISPATCHED = Counter("sluice_redispatched_requests", "Requests sent again after their worker died.")
EJECTED = Gauge(
    "sluice_replica_ejected",
    "1 while a worker gets none of a model version's requests after failing them on its device; 0 once back.",
    ["worker", "model", "version"], multiprocess_mode="livemax",
)
RETRIED = Counter(
    "sluice_retried_requests", "Requests sent to another replica after their replica's device failed them.",
    ["model", "version"],
)
PREFIX_ROUTED = Counter(
    "sluice_prefix_routed_requests",
    "Generations sent to one of several replicas: by prefix affinity (where their prompt's prefix is "
    "cached) or by load.", ["model", "version", "by"],
)

# Per tenant and priority class; the tenant label is bounded by the tenants file ("local" without one).
TENANT_ADMITTED = Counter(
    "sluice_tenant_admitted", "Requests admitted past the tenant's limits.", ["tenant", "class"],
)
TENANT_REJECTED = Counter(
    "sluice_tenant_rejected",
    "Requests refused before admission, by reason: a tenant's limit (requests, tokens, concurrency, credits), "
    "or the gateway's (overloaded: the replicas' queues already too long; expired: the deadline passed before "
    "dispatch). An admitted request is never counted here: see sluice_requests_total for how it ended.",
    ["tenant", "class", "reason"],
)
TENANT_GOODPUT = Counter(
    "sluice_tenant_goodput", "Requests completed successfully within their deadline.", ["tenant", "class"],
)
TENANT_DEVICE_SECONDS = Counter(
    "sluice_tenant_device_seconds", "Device time used by the tenant's requests (each batch split by cost).",
    ["tenant", "class"],
)
SHARED_LIMITS_ERRORS = Counter(
    "sluice_shared_limits_errors",
    "Calls to the shared limits in Redis that failed (this gateway's own limits applied instead).",
)
TENANT_RELOADS = Counter(
    "sluice_tenants_reloads",
    "Reloads of the tenants file (SIGHUP or POST /admin/reload), by outcome: reloaded, or failed (the file "
    "did not load and the tenants before it stay in force).", ["outcome"],
)
TENANTS_RELOAD_FAILED = Gauge(
    "sluice_tenants_reload_failed",
    "1 while the last reload of the tenants file failed (the tenants in force are not the file's); 0 after a "
    "good one.", multiprocess_mode="livemax",
)
TENANT_QUEUE_WAIT = Histogram(
    "sluice_tenant_queue_wait_seconds", "Time the tenant's requests waited in a worker's queue.",
    ["tenant", "class"], buckets=_LATENCY_BUCKETS,
)

# Generation, measured at the gateway as the client sees it (the definitions `vllm bench serve` uses).
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                  5.0, 10.0)
TIME_TO_FIRST_TOKEN = Histogram(
    "sluice_time_to_first_token_seconds", "From arrival to the first streamed output.", ["model"],
    buckets=_LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "sluice_inter_token_latency_seconds", "Between consecutive streamed outputs of one request.", ["model"],
    buckets=_TOKEN_BUCKETS,
)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "sluice_time_per_output_token_seconds", "(end-to-end - time to first token) / (output tokens - 1).",
    ["model"], buckets=_TOKEN_BUCKETS,
)
GENERATION_DURATION = Histogram(
    "sluice_generation_duration_seconds", "End-to-end time of a completed generation.", ["model"],
    buckets=_LATENCY_BUCKETS,
)
PROMPT_TOKENS = Counter("sluice_prompt_tokens", "Prompt tokens of completed generations.", ["model"])
CACHED_PROMPT_TOKENS = Counter("sluice_cached_prompt_tokens", "Prompt tokens served from the prefix cache.",
                               ["model"])
GENERATION_TOKENS = Counter("sluice_generation_tokens", "Output tokens of completed generations.", ["model"])

# Generative engines, per worker. The `vllm:` names are what the Kubernetes Gateway API Inference
# Extension (and other LLM routers) read, so they can drive sluice workers unchanged.
SEQUENCES_RUNNING = Gauge(
    "vllm:num_requests_running", "Sequences running in the engine (holding KV blocks).", ["model_name"],
    multiprocess_mode="livesum",
)
SEQUENCES_WAITING = Gauge(
    "vllm:num_requests_waiting", "Sequences waiting for KV blocks or a slot.", ["model_name"],
    multiprocess_mode="livesum",
)
KV_CACHE_USAGE = Gauge(
    "vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", ["model_name"],
    multiprocess_mode="livemax",
)
PREEMPTIONS = Counter("sluice_preemptions", "Sequences preempted (freed, recomputed later).", ["model"])
PREFIX_CACHE_QUERIES = Counter("sluice_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                               ["model"])
PREFIX_CACHE_HITS = Counter("sluice_prefix_cache_hits", "Prompt tokens found in the prefix cache.", ["model"])

# The gateway's result cache (gateway/cache.py).
CACHE_LOOKUPS = Counter(
    "sluice_cache_lookups",
    "Cacheable requests, by how they were answered: hit (stored answer), coalesced (an identical request's run), "
    "miss (run on a device).",
    ["model", "result"],
)
CACHE_ENTRIES = Gauge("sluice_cache_entries", "Answers held in the gateway's own result cache.",
                      multiprocess_mode="livesum")
CACHE_BYTES = Gauge("sluice_cache_bytes", "Approximate memory held by the gateway's own result cache.",
                    multiprocess_mode="livesum")
TRAFFIC_SHARE = Gauge("sluice_traffic_share", "Share (0-1) of a model's requests that name no version sent to "
                      "each version: its traffic split, or its canary's current step.", ["model", "version"],
                      multiprocess_mode="livemax")
CANARY_EVENTS = Counter("sluice_canary_events", "Canary steps passed and canaries ended, by what happened "
                        "(advanced, promoted, rolled_back).", ["model", "event"])
SHADOW_REQUESTS = Counter(
    "sluice_shadow_requests", "Copies of requests sent to a model's shadow version (never answered to a client), by "
    "outcome: ok, failed (device, worker or internal failure), refused (overload), expired (the original's "
    "deadline passed), invalid (the version refused the input), dropped (the version is not served, or the "
    "gateway is shutting down).", ["model", "version", "outcome"])
SHADOW_LATENCY = Histogram("sluice_shadow_latency_seconds", "Time from a request's arrival to its shadow copy's "
                           "answer, for copies answered ok.", ["model", "version"], buckets=_LATENCY_BUCKETS)
SHADOW_COMPARISONS = Counter(
    "sluice_shadow_comparisons", "Shadow copies answered ok whose outputs were compared with the answer the client "
    "got: same (within a relative tolerance of 1e-3) or different. Generations are not compared.",
    ["model", "version", "result"])
CACHE_EVICTIONS = Counter("sluice_cache_evictions", "Answers dropped from the gateway's own cache to make room.")
CACHE_ERRORS = Counter("sluice_cache_errors", "Calls to the shared result cache in Redis that failed (a miss).")


def log_lines_dropped(process: str) -> Callable[[int], None]:
    """The recorder of `process`'s dropped log lines (`logs.configure`'s `on_dropped`); exported at 0 from now."""
    return LOG_LINES_DROPPED.labels(process).inc


def tenant_label(tenant: str) -> str:
    return tenant or "local"


class CacheStore(Protocol):
    num_bytes: int
    num_evicted: int

    def __len__(self) -> int: ...


class CacheCounts(Protocol):
    @property
    def lookups(self) -> Mapping[tuple[str, str], int]: ...

    @property
    def local(self) -> CacheStore | None: ...


class GenerationCounts(Protocol):
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_cached_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...

_JOB_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 4 * 3600.0, 12 * 3600.0, 24 * 3600.0)
BATCH_ITEMS = Counter(
    "sluice_batch_items", "Batch-job items finished, by outcome (ok, error, dead_letter, cancelled, expired).",
    ["outcome"],
)
BATCH_ITEM_RETRIES = Counter("sluice_batch_item_retries", "Batch-job item attempts that failed transiently.")
BATCH_ITEMS_PENDING = Gauge(
    "sluice_batch_items_pending",
    "Unfinished items of active batch jobs, by state: queued (in the job store, the same on every gateway "
    "sharing it: aggregate with max) and running (on this gateway: aggregate with sum).",
    ["state"], multiprocess_mode="livesum",
)
BATCH_ITEMS_WAITING = Gauge(
    "sluice_batch_items_waiting_for_model",
    "Batch-job items whose last answer was a 503 while the server or their model was not up (their model "
    "loading, or its worker being restarted): they wait for it, without using attempts, until their batch "
    "expires. Counted by "
    "the gateway that ran them: aggregate with sum.",
    ["model"], multiprocess_mode="livesum",
)
BACKGROUND_RESPONSES = Counter(
    "sluice_background_responses",
    "Background responses (/v1/responses, background: true) that ended, by status: completed, incomplete, "
    "failed (counted by the gateway that ran them), cancelled (by the gateway that cancelled them).",
    ["status"],
)
BACKGROUND_RUNNING = Gauge(
    "sluice_background_responses_running", "Background responses running on this gateway.",
    multiprocess_mode="livesum",
)
BACKGROUND_TAKEOVERS = Counter(
    "sluice_background_responses_taken_over",
    "Background responses this gateway took over after the gateway running them stopped.",
)
BATCH_JOBS = Counter("sluice_batch_jobs", "Batch jobs that reached a final status, by status.", ["status"])
BATCH_JOB_DURATION = Histogram(
    "sluice_batch_job_duration_seconds", "Batch job time from creation to its final status.", ["status"],
    buckets=_JOB_BUCKETS,
)


_CHILDREN: dict[tuple[Any, tuple[str, ...]], Any] = {}


def _child(metric: Any, *labels: str) -> Any:
    """`metric.labels(*labels)`, remembered: the lookup costs more than the update it precedes, on
    every request. Bounded like the labels themselves (models, outcomes, tenants in the file)."""
    key = (metric, labels)
    child = _CHILDREN.get(key)
    if child is None:
        child = _CHILDREN[key] = metric.labels(*labels)
    return child


class JobMetrics:
    """The batch-job executor's recorder."""

    def item_done(self, outcome: str, count: int = 1) -> None:
        if count:
            _child(BATCH_ITEMS, outcome).inc(count)

    def item_retried(self) -> None:
        BATCH_ITEM_RETRIES.inc()

    def pending(self, num_queued: int, num_running: int) -> None:
        _child(BATCH_ITEMS_PENDING, "queued").set(num_queued)
        _child(BATCH_ITEMS_PENDING, "running").set(num_running)

    def waiting_for_models(self, counts: Mapping[str, int]) -> None:
        """Items waiting for each model now (a model absent from `counts` has none any more)."""
        for model, count in counts.items():
            _child(BATCH_ITEMS_WAITING, model).set(count)

    def job_done(self, status: str, seconds: float) -> None:
        _child(BATCH_JOBS, status).inc()
        _child(BATCH_JOB_DURATION, status).observe(max(seconds, 0.0))


class BackgroundMetrics:
    """The background responses' runner's recorder."""

    def ended(self, status: str) -> None:
        _child(BACKGROUND_RESPONSES, status).inc()

    def running(self, count: int) -> None:
        BACKGROUND_RUNNING.set(count)

    def taken_over(self) -> None:
        BACKGROUND_TAKEOVERS.inc()


class EngineCounts(Protocol):
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_cache_usage(self) -> float: ...
    @property
    def num_preemptions_total(self) -> int: ...
    @property
    def prefix_cache_query_tokens(self) -> int: ...
    @property
    def prefix_cache_hit_tokens(self) -> int: ...


class _Demand:
    """What gateways and workers both record: the demand they turn away."""

    def refused_work(self, model: str, version: str, seconds: float) -> None:
        """A request refused for overload, by the device time it would have used."""
        _child(REFUSED_WORK, model, version).inc(seconds)


class GatewayMetrics(_Demand):
    def __init__(self) -> None:
        self._counted: dict[Any, float] = {}
        """Counters kept elsewhere and exported on scrape: how much of each this registry has."""
        self._shares_seen: set[tuple[str, str]] = set()
        self._ejections_seen: set[tuple[str, str, str]] = set()

    def cache_error(self) -> None:
        CACHE_ERRORS.inc()

    def request_done(self, model: str, version: str, outcome: str, seconds: float, *,
                     client_deadline: bool = False) -> None:
        """`client_deadline`: the request's deadline was the client's own, not the model's SLO."""
        _child(REQUESTS, model, version, outcome).inc()
        _child(REQUEST_DURATION, model, version, outcome).observe(seconds)
        if outcome == "expired":
            _child(EXPIRED, model, version, "client" if client_deadline else "slo").inc()

    def workers_ready(self, count: int) -> None:
        WORKERS_READY.set(count)

    def worker_restarted(self) -> None:
        WORKER_RESTARTS.inc()

    def canary_event(self, model: str, event: str) -> None:
        _child(CANARY_EVENTS, model, event).inc()

    def traffic_shares(self, shares: dict[tuple[str, str], float]) -> None:
        """Each served (model, version)'s share of the requests that name no version (on scrape);
        0 for a version no longer served."""
        for model, version in self._shares_seen - shares.keys():
            _child(TRAFFIC_SHARE, model, version).set(0.0)
        for (model, version), share in shares.items():
            _child(TRAFFIC_SHARE, model, version).set(share)
        self._shares_seen |= shares.keys()

    def redispatched(self, count: int) -> None:
        REDISPATCHED.inc(count)

    def ejections(self, replicas: dict[tuple[str, str, str], bool]) -> None:
        """On scrape: each replica that failed since its last success, ejected or not; a replica
        that has succeeded since reads 0."""
        for key in self._ejections_seen - replicas.keys():
            _child(EJECTED, *key).set(0.0)
        for key, is_ejected in replicas.items():
            _child(EJECTED, *key).set(1.0 if is_ejected else 0.0)
        self._ejections_seen |= replicas.keys()

    def shadow_done(self, model: str, version: str, outcome: str, seconds: float | None = None) -> None:
        """A shadow copy to `version` ended; `seconds`: its latency, if it was answered ok."""
        _child(SHADOW_REQUESTS, model, version, outcome).inc()
        if seconds is not None:
            _child(SHADOW_LATENCY, model, version).observe(seconds)

    def shadow_compared(self, model: str, version: str, is_same: bool) -> None:
        _child(SHADOW_COMPARISONS, model, version, "same" if is_same else "different").inc()

    def retried(self, model: str, version: str) -> None:
        _child(RETRIED, model, version).inc()

    def prefix_routed(self, model: str, version: str, by_affinity: bool) -> None:
        _child(PREFIX_ROUTED, model, version, "prefix" if by_affinity else "load").inc()

    def cache_state(self, cache: CacheCounts) -> None:
        """The result cache's counts, brought up to date (on each scrape: cheaper than on each request)."""
        for (model, result), count in cache.lookups.items():
            child = _child(CACHE_LOOKUPS, model, result)
            behind = count - self._counted.get(child, 0)
            if behind > 0:
                child.inc(behind)
                self._counted[child] = count
        local = cache.local
        if local is not None:
            CACHE_ENTRIES.set(len(local))
            CACHE_BYTES.set(local.num_bytes)
            behind = local.num_evicted - self._counted.get(CACHE_EVICTIONS, 0)
            if behind > 0:
                CACHE_EVICTIONS.inc(behind)
                self._counted[CACHE_EVICTIONS] = local.num_evicted

    def first_token(self, model: str, seconds: float) -> None:
        _child(TIME_TO_FIRST_TOKEN, model).observe(seconds)

    def inter_token(self, model: str, seconds: float) -> None:
        _child(INTER_TOKEN_LATENCY, model).observe(seconds)

    def generation_done(self, model: str, result: GenerationCounts, e2e_s: float, ttft_s: float | None) -> None:
        _child(GENERATION_DURATION, model).observe(e2e_s)
        _child(PROMPT_TOKENS, model).inc(result.num_prompt_tokens)
        _child(CACHED_PROMPT_TOKENS, model).inc(result.num_cached_tokens)
        _child(GENERATION_TOKENS, model).inc(result.num_output_tokens)
        if ttft_s is not None and result.num_output_tokens > 1:
            _child(TIME_PER_OUTPUT_TOKEN, model).observe(max(e2e_s - ttft_s, 0.0) / (result.num_output_tokens - 1))

    def tenant_admitted(self, tenant: str, klass: str) -> None:
        _child(TENANT_ADMITTED, tenant_label(tenant), klass).inc()

    def tenant_rejected(self, tenant: str, klass: str, reason: str) -> None:
        _child(TENANT_REJECTED, tenant_label(tenant), klass, reason).inc()

    def tenant_completed(self, tenant: str, klass: str, queue_s: float | None, device_s: float, *,
                         on_time: bool = True) -> None:
        """A successful request; goodput only if it was answered within its deadline. `queue_s`:
        None for an answer from the result cache, which waited in no worker's queue (a 0 there
        would pull the tenant's queue-wait percentiles down by its cache's hit rate)."""
        label = tenant_label(tenant)
        if on_time:
            _child(TENANT_GOODPUT, label, klass).inc()
        if queue_s is not None:
            _child(TENANT_QUEUE_WAIT, label, klass).observe(queue_s)
        _child(TENANT_DEVICE_SECONDS, label, klass).inc(device_s)

    def shared_limits_error(self) -> None:
        SHARED_LIMITS_ERRORS.inc()

    def tenants_reloaded(self, is_ok: bool | None) -> None:
        """A reload of the tenants file that loaded (`is_ok`) or failed; None: the file as loaded
        at start (the series exist, at 0, before the first reload)."""
        for outcome in ("reloaded", "failed"):
            _child(TENANT_RELOADS, outcome).inc(1 if is_ok is (outcome == "reloaded") else 0)
        TENANTS_RELOAD_FAILED.set(1.0 if is_ok is False else 0.0)

    def tenant_used(self, tenant: str, klass: str, device_s: float) -> None:
        """Device time of a request that ran but did not succeed (still paid for)."""
        if device_s > 0:
            _child(TENANT_DEVICE_SECONDS, tenant_label(tenant), klass).inc(device_s)


class WorkerMetrics(_Demand):
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self._busy = _child(DEVICE_BUSY, worker_id)
        self._busy_ratio = _child(DEVICE_BUSY_RATIO, worker_id)
        self._engine_stats: dict[tuple[str, str], EngineCounts] = {}
        """Each generative engine's last report, by (model, version)."""

    def batch_done(self, model: str, version: str, size: int, exec_s: float, waits_s: list[float]) -> None:
        _child(BATCH_SIZE, model, version).observe(size)
        _child(EXECUTION, model, version).observe(exec_s)
        wait = _child(QUEUE_WAIT, model, version)
        for w in waits_s:
            wait.observe(w)
        self.device_busy(exec_s)

    def device_busy(self, seconds: float) -> None:
        """The device computed for `seconds` (a batch, or a generative engine's step)."""
        self._busy.inc(seconds)

    def item_failed(self, model: str, version: str) -> None:
        _child(ITEM_FAILURES, model, version).inc()

    def queue(self, model: str, version: str, depth: int, work_s: float) -> None:
        _child(QUEUE_DEPTH, model, version).set(depth)
        _child(QUEUED_WORK, model, version).set(work_s)

    def profile(self, model: str, version: str, alpha_s: float, beta_s: float) -> None:
        _child(PROFILE_ALPHA, model, version, self.worker_id).set(alpha_s)
        _child(PROFILE_BETA, model, version, self.worker_id).set(beta_s)

    def busy_ratio(self, ratio: float) -> None:
        self._busy_ratio.set(ratio)

    def upstreams(self, loads: Iterable[tuple[str, int, int]]) -> None:
        """The `openai-upstream` models' load, as (model, calls in flight to its server, calls
        waiting here) per version served: a model's versions add up (its series are per model)."""
        totals: dict[str, tuple[int, int]] = {}
        for model, num_running, num_waiting in loads:
            running, waiting = totals.get(model, (0, 0))
            totals[model] = (running + num_running, waiting + num_waiting)
        for model, (running, waiting) in totals.items():
            _child(SEQUENCES_RUNNING, model).set(running)
            _child(SEQUENCES_WAITING, model).set(waiting)

    def engine_started(self, model: str, version: str, stats: EngineCounts) -> None:
        """A generative engine about to serve, warmed up: what its counters hold now (its warm-up
        generation, or nothing) is not the clients' and is not counted."""
        self._engine_stats[(model, version)] = stats

    def engines(self, engines: Mapping[tuple[str, str], EngineCounts]) -> None:
        """The generative engines' state, one engine per (model, version) served here. The series
        are per model (`model_name`, as vLLM's): its versions' sequences add up, its KV cache is
        the fullest version's, and each counter advances by each engine's own change since that
        engine's last report (two versions must not be taken for one engine going up and down)."""
        by_model: dict[str, list[tuple[EngineCounts, EngineCounts | None]]] = {}
        for key, stats in engines.items():
            by_model.setdefault(key[0], []).append((stats, self._engine_stats.get(key)))
            self._engine_stats[key] = stats
        for model, reports in by_model.items():
            _child(SEQUENCES_RUNNING, model).set(sum(stats.num_running for stats, _ in reports))
            _child(SEQUENCES_WAITING, model).set(sum(stats.num_waiting for stats, _ in reports))
            _child(KV_CACHE_USAGE, model).set(max(stats.kv_cache_usage for stats, _ in reports))
            for counter, field in ((PREEMPTIONS, "num_preemptions_total"),
                                   (PREFIX_CACHE_QUERIES, "prefix_cache_query_tokens"),
                                   (PREFIX_CACHE_HITS, "prefix_cache_hit_tokens")):
                child = _child(counter, model)  # exported from the first report, at 0 until it happens
                for stats, previous in reports:
                    now, before = getattr(stats, field), getattr(previous, field) if previous else 0
                    if now > before:
                        child.inc(now - before)


_WORKER_FAMILIES = frozenset(metric._name for metric in (
    QUEUE_WAIT, EXECUTION, BATCH_SIZE, DEVICE_BUSY, REFUSED_WORK, DEVICE_BUSY_RATIO, QUEUE_DEPTH, QUEUED_WORK,
    PROFILE_ALPHA, PROFILE_BETA, ITEM_FAILURES, SEQUENCES_RUNNING, SEQUENCES_WAITING, KV_CACHE_USAGE, PREEMPTIONS,
    PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS,
))
"""The families a worker records (`WorkerMetrics`): its own `/metrics` shows these and no other sluice's."""


class _WorkerCollector:
    """The default registry less the gateway's families. Declared at import in every process, the
    gateway's unlabelled series would read 0 on a worker's own `/metrics` (`sluice worker
    --metrics-port`): `sluice_workers_ready 0` there fired SluiceNoWorkersReady for every
    healthy worker a Prometheus scrapes, and `sluice_cache_entries 0` claimed a cache it has none of."""

    def collect(self) -> Iterable[Any]:
        from prometheus_client import REGISTRY

        for family in REGISTRY.collect():
            if family.name in _WORKER_FAMILIES or not family.name.startswith(("sluice_", "vllm:")):
                yield family


def worker_registry() -> CollectorRegistry:
    """What a standalone worker serves on its `--metrics-port`: its own series, and the process's;
    without prometheus-client's `*_created` series, as the gateway's merged exposition (a gauge
    family beside each counter and histogram, doubling the worker's series, documented nowhere)."""
    from prometheus_client import disable_created_metrics

    disable_created_metrics()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_WorkerCollector())
    return registry


def exposition() -> tuple[bytes, str]:
    """The text exposition for `/metrics`, merging worker processes when in multiprocess mode."""
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        _multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def mark_process_dead(pid: int) -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        _multiprocess.mark_process_dead(pid)

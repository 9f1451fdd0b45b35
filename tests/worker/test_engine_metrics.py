"""What a worker's generative engines put in `/metrics`: the `vllm:` gauges LLM routers read, and
the engine's counters, when one model is served in several versions (an A/B split, a canary)."""

from __future__ import annotations

from prometheus_client import REGISTRY

from sluice.engines.generative.engine import EngineStats
from sluice.metrics import WorkerMetrics


def _stats(running: int, waiting: int, kv: float, queried: int, hits: int, preempted: int = 0) -> EngineStats:
    return EngineStats(num_running=running, num_waiting=waiting, kv_cache_usage=kv,
                       num_preemptions_total=preempted, prefix_cache_query_tokens=queried,
                       prefix_cache_hit_tokens=hits, last_step=None)


def _value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_a_models_versions_add_up_rather_than_the_last_one_hiding_the_others() -> None:
    """Seen: with tiny-lm v1 and v2 on one worker, four sequences running on v1 read as
    `vllm:num_requests_running 0` (v2's idle engine overwrote v1's), and the prefix-cache
    counters took v1 and v2 for one engine going up and down."""
    model = "two-versions"
    metrics = WorkerMetrics("engine-metrics-test")
    metrics.engines({(model, "1"): _stats(4, 1, 0.25, queried=100, hits=10, preempted=2),
                     (model, "2"): _stats(0, 0, 0.0, queried=4, hits=0)})
    assert _value("vllm:num_requests_running", model_name=model) == 4
    assert _value("vllm:num_requests_waiting", model_name=model) == 1
    assert _value("vllm:kv_cache_usage_perc", model_name=model) == 0.25
    assert _value("sluice_prefix_cache_queries_total", model=model) == 104
    assert _value("sluice_prefix_cache_hits_total", model=model) == 10
    assert _value("sluice_preemptions_total", model=model) == 2

    # Next report: v2 got busy, v1 finished; each counter advances by each engine's own change.
    metrics.engines({(model, "1"): _stats(0, 0, 0.0, queried=130, hits=20, preempted=2),
                     (model, "2"): _stats(3, 0, 0.5, queried=24, hits=4, preempted=1)})
    assert _value("vllm:num_requests_running", model_name=model) == 3
    assert _value("vllm:num_requests_waiting", model_name=model) == 0
    assert _value("vllm:kv_cache_usage_perc", model_name=model) == 0.5
    assert _value("sluice_prefix_cache_queries_total", model=model) == 104 + 30 + 20
    assert _value("sluice_prefix_cache_hits_total", model=model) == 10 + 10 + 4
    assert _value("sluice_preemptions_total", model=model) == 3


def test_an_upstream_models_versions_add_up_too() -> None:
    """The same for `openai-upstream` models, whose calls in flight and waiting are these series."""
    model = "two-upstream-versions"
    WorkerMetrics("engine-metrics-test").upstreams([(model, 5, 2), (model, 0, 0)])
    assert _value("vllm:num_requests_running", model_name=model) == 5
    assert _value("vllm:num_requests_waiting", model_name=model) == 2


def test_an_engines_warm_up_is_not_counted_and_a_reloaded_version_counts_from_its_start() -> None:
    """Seen: an idle server just started showed `sluice_prefix_cache_queries_total` 4 per
    generative version (the warm-up generation's prompt), and 4 more after each worker restart."""
    model = "warmed-up"
    metrics = WorkerMetrics("engine-metrics-test")
    metrics.engine_started(model, "1", _stats(0, 0, 0.0, queried=4, hits=0))
    metrics.engines({(model, "1"): _stats(0, 0, 0.0, queried=4, hits=0)})
    assert _value("sluice_prefix_cache_queries_total", model=model) == 0
    metrics.engines({(model, "1"): _stats(1, 0, 0.1, queried=24, hits=0)})
    assert _value("sluice_prefix_cache_queries_total", model=model) == 20

    # Unloaded and loaded again: a new engine, whose counters start again from its own warm-up.
    metrics.engine_started(model, "1", _stats(0, 0, 0.0, queried=4, hits=0))
    metrics.engines({(model, "1"): _stats(0, 0, 0.0, queried=14, hits=8)})
    assert _value("sluice_prefix_cache_queries_total", model=model) == 30
    assert _value("sluice_prefix_cache_hits_total", model=model) == 8

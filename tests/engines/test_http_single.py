"""The `http-single` runner alone, against a real HTTP upstream on loopback (tests/upstream_server.py)."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from sluice import wire
from sluice.circuit import CircuitState
from sluice.engines import ItemFailure, PreparedItem, load_runner
from sluice.engines.http_single import HttpSingleRunner, backoff_delay_s, upstream_prior
from sluice.errors import ConfigError, InvalidInput
from sluice.repository import BatchingConfig, ModelVersion, scan_repository, verify
from tests.upstream_server import UpstreamServer, expected_text_output


@pytest.fixture
def upstream() -> Iterator[UpstreamServer]:
    with UpstreamServer() as server:
        yield server


def _version(url: str, max_batch_size: int = 64, **params: object) -> ModelVersion:
    return ModelVersion(
        name="up", version="1", kind="http-single", platform="sluice_http-single",
        batching=BatchingConfig(max_batch_size=max_batch_size), slo_s=1.0, weights_dir=Path("."),
        manifest_path=Path("SHA256SUMS"), params={"url": url, "backoff_ms": 1, **params},
    )


@pytest.fixture
def make_runner() -> Iterator:
    runners: list[HttpSingleRunner] = []

    def make(url: str, **params: object) -> HttpSingleRunner:
        runner = load_runner(_version(url, **params), "cpu")
        assert isinstance(runner, HttpSingleRunner)
        runners.append(runner)
        return runner

    yield make
    for runner in runners:
        runner.close()


def _texts(*texts: str) -> list[PreparedItem]:
    return [PreparedItem(cost=1, data=t) for t in texts]


def test_text_and_tensor_items_come_back_in_order(upstream, make_runner):
    runner = make_runner(upstream.url, concurrency=4)
    texts = [f"sentence number {i}" for i in range(10)]
    outputs = runner.run_batch(runner.prepare(wire.TextPayload(texts)))
    for text, output in zip(texts, outputs, strict=True):
        assert isinstance(output, np.ndarray)
        np.testing.assert_allclose(output, expected_text_output(text), rtol=1e-6)
    rows = np.arange(24, dtype=np.float32).reshape(6, 4)
    items = runner.prepare(wire.TensorPayload("float32", (6, 4), rows.tobytes()))
    outputs = runner.run_batch(items)
    np.testing.assert_allclose(np.stack(outputs), rows.sum(axis=1))  # type: ignore[arg-type]
    packed = runner.pack(outputs)  # type: ignore[arg-type]
    assert isinstance(packed, wire.TensorPayload) and packed.shape == (6,)


def test_malformed_tensor_requests_are_invalid_input(upstream, make_runner):
    runner = make_runner(upstream.url)
    with pytest.raises(InvalidInput):
        runner.prepare(wire.TensorPayload("int32", (1, 2), bytes(8)))
    with pytest.raises(InvalidInput):
        runner.prepare(wire.TensorPayload("float32", (2,), bytes(8)))


def test_concurrency_limit_is_never_exceeded_and_is_used(upstream, make_runner):
    upstream.delay_s = 0.05
    runner = make_runner(upstream.url, concurrency=4)
    started = time.perf_counter()
    outputs = runner.run_batch(_texts(*(f"t{i}" for i in range(20))))
    elapsed = time.perf_counter() - started
    assert not any(isinstance(o, ItemFailure) for o in outputs)
    assert upstream.max_in_flight == 4
    assert upstream.num_requests == 20
    assert 0.25 <= elapsed < 2.0, "20 calls, 4 at a time, 50 ms each: about 5 rounds (serial: 1 s, and max_in_flight 1)"


def test_a_call_that_passes_its_timeout_fails_its_item_only(upstream, make_runner):
    upstream.slow_next, upstream.slow_s = 1, 2.0
    runner = make_runner(upstream.url, concurrency=1, timeout_ms=100, max_attempts=1)
    started = time.perf_counter()
    outputs = runner.run_batch(_texts("slow", "fast"))
    assert time.perf_counter() - started < 1.0
    assert isinstance(outputs[0], ItemFailure) and "timed out after 100 ms" in outputs[0].message
    assert isinstance(outputs[1], np.ndarray)


def test_5xx_is_retried_then_succeeds(upstream, make_runner):
    upstream.fail_next, upstream.fail_status = 2, 503
    runner = make_runner(upstream.url, concurrency=1, max_attempts=3)
    [output] = runner.run_batch(_texts("hello"))
    assert isinstance(output, np.ndarray)
    assert upstream.num_requests == 3


def test_a_timeout_is_retried_then_succeeds(upstream, make_runner):
    upstream.slow_next, upstream.slow_s = 1, 2.0
    runner = make_runner(upstream.url, concurrency=1, timeout_ms=150, max_attempts=2)
    [output] = runner.run_batch(_texts("hello"))
    assert isinstance(output, np.ndarray)
    assert upstream.num_requests == 2


def test_retried_out_5xx_fails_that_item_with_the_reason(upstream, make_runner):
    runner = make_runner(upstream.url, concurrency=2, max_attempts=3, failure_threshold=100)
    outputs = runner.run_batch(_texts("a", "status:502", "b"))
    assert isinstance(outputs[0], np.ndarray) and isinstance(outputs[2], np.ndarray)
    assert isinstance(outputs[1], ItemFailure)
    assert outputs[1].message == "upstream failed after 3 attempts: HTTP 502"
    assert upstream.num_requests == 2 + 3


def test_4xx_is_final_and_not_retried(upstream, make_runner):
    runner = make_runner(upstream.url, concurrency=1, max_attempts=5, failure_threshold=1)
    [output] = runner.run_batch(_texts("status:400"))
    assert isinstance(output, ItemFailure)
    assert output.message.startswith("upstream rejected the item: HTTP 400")
    assert upstream.num_requests == 1
    assert runner.breaker.state is CircuitState.CLOSED, "a refused item says nothing about the upstream's health"


def test_an_unusable_answer_fails_its_item(upstream, make_runner):
    runner = make_runner(upstream.url, output_field="result", output_dims=16)
    [output] = runner.run_batch(_texts("x"))
    assert isinstance(output, ItemFailure) and "without a numeric 'result'" in output.message
    runner = make_runner(upstream.url, output_dims=16)
    outputs = runner.run_batch([PreparedItem(1, np.ones(3, np.float32)), *_texts("y")])
    assert isinstance(outputs[0], ItemFailure) and "expected shape [16]" in outputs[0].message
    assert isinstance(outputs[1], np.ndarray)


def test_circuit_opens_fails_fast_then_recovers(upstream, make_runner):
    upstream.fail_rate, upstream.fail_status = 1.0, 500
    runner = make_runner(upstream.url, concurrency=1, max_attempts=1, failure_threshold=3, open_s=1.0)
    outputs = runner.run_batch(_texts(*"abcde"))
    assert upstream.num_requests == 3, "after 3 consecutive failures no more calls go out"
    assert [o.message.startswith("upstream unavailable") for o in outputs] == [False] * 3 + [True] * 2  # type: ignore[union-attr]
    assert runner.breaker.state is CircuitState.OPEN
    started = time.perf_counter()
    outputs = runner.run_batch(_texts(*"fgh"))
    assert time.perf_counter() - started < 0.5 and all(isinstance(o, ItemFailure) for o in outputs)
    assert upstream.num_requests == 3  # failed fast: no call went out while open
    upstream.fail_rate = 0.0
    time.sleep(1.05)
    outputs = runner.run_batch(_texts("trial"))
    assert isinstance(outputs[0], np.ndarray)
    assert runner.breaker.state is CircuitState.CLOSED
    assert all(isinstance(o, np.ndarray) for o in runner.run_batch(_texts(*"ijk")))


def test_an_unreachable_upstream_fails_items_with_a_connection_error(make_runner):
    with UpstreamServer() as gone:
        url = gone.url
    runner = make_runner(url, max_attempts=2)
    [output] = runner.run_batch(_texts("x"))
    assert isinstance(output, ItemFailure) and "connection error" in output.message


def test_warmup_is_off_by_default_and_measures_when_given_an_input(upstream, make_runner):
    assert make_runner(upstream.url).warmup() == []
    assert upstream.num_requests == 0
    upstream.delay_s = 0.03
    timings = make_runner(upstream.url, concurrency=4, warmup_input="warm").warmup()
    assert [cost for cost, _ in timings] == [1, 4, 1, 4]
    assert all(0.03 <= seconds < 0.5 for _, seconds in timings)


def test_prior_predicts_rounds_of_calls():
    assert upstream_prior(0.1, concurrency=8, max_batch_size=8) == (0.1, 0.0, 1.0)
    alpha, beta, _ = upstream_prior(0.1, concurrency=4, max_batch_size=32)
    for n in range(1, 33):
        rounds = -(-n // 4)
        assert rounds * 0.1 - 1e-9 <= alpha + beta * n < rounds * 0.1 + 0.1, "an upper bound within one call"
    assert alpha + beta * 5 == pytest.approx(0.2)


def test_backoff_is_exponential_with_full_jitter():
    rng = random.Random(1)
    delays = [[backoff_delay_s(attempt, 0.1, 1.0, rng) for _ in range(200)] for attempt in (1, 2, 3, 6)]
    assert [max(d) <= cap for d, cap in zip(delays, (0.1, 0.2, 0.4, 1.0), strict=True)] == [True] * 4
    assert min(delays[2]) < 0.05 < max(delays[2])


@pytest.mark.parametrize("params", [{"url": "ftp://x"}, {"concurrency": 0}, {"timeout_ms": 0},
                                    {"max_attempts": "many"}, {"failure_threshold": 0}, {"open_s": 0}])
def test_bad_parameters_are_refused(params):
    version = _version("http://127.0.0.1:9/infer")
    version = dataclasses.replace(version, params={**version.params, **params})
    with pytest.raises(ConfigError):
        load_runner(version, "cpu")


def test_repository_needs_no_manifest_and_batches_at_the_concurrency(tmp_path):
    model = tmp_path / "up"
    (model / "1").mkdir(parents=True)
    (model / "model.toml").write_text('kind = "http-single"\n[params]\nurl = "http://127.0.0.1:9/infer"\n'
                                      "concurrency = 6\n")
    [version] = scan_repository(tmp_path).versions
    verify(version)
    assert version.batching.max_batch_size == 6

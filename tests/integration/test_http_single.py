"""A real `sluice serve` with an `http-single` model in front of a test upstream API on loopback."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import ServerProcess, eventually
from tests.upstream_server import UpstreamServer, expected_text_output

UPSTREAM_DELAY_S = 0.04


@pytest.fixture
def upstream() -> Iterator[UpstreamServer]:
    with UpstreamServer(delay_s=UPSTREAM_DELAY_S) as server:
        yield server


def _serve(make_server, tmp_path: Path, url: str, **params: object) -> ServerProcess:
    settings = {"concurrency": 4, "timeout_ms": 1000, "max_attempts": 2, "backoff_ms": 5,
                "failure_threshold": 1000, "expected_latency_ms": 200, **params}
    model = tmp_path / "models" / "up"
    (model / "1").mkdir(parents=True)
    lines = ['kind = "http-single"', "[slo]", "default_ms = 5000", "[params]", f'url = "{url}"']
    (model / "model.toml").write_text("\n".join(lines + [f"{k} = {v}" for k, v in settings.items()]) + "\n")
    return make_server(tmp_path / "models")


@pytest.fixture
def server(upstream: UpstreamServer, make_server, tmp_path: Path) -> ServerProcess:
    return _serve(make_server, tmp_path, upstream.url)


def _embed(url: str, texts: list[str]) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json={"model": "up", "input": texts}, timeout=30)


def _infer_body(rows: np.ndarray) -> dict[str, object]:
    return {"inputs": [{"name": "INPUT0", "shape": list(rows.shape), "datatype": "FP32",
                        "data": rows.ravel().tolist()}]}


def test_openai_embeddings_and_kserve_infer_return_per_item_results_in_order(server):
    texts = [f"sentence {i}" for i in range(7)]
    response = _embed(server.url, texts)
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(7))
    for text, entry in zip(texts, data, strict=True):
        np.testing.assert_allclose(entry["embedding"], expected_text_output(text), rtol=1e-5)

    rows = np.arange(30, dtype=np.float32).reshape(6, 5)
    response = httpx.post(f"{server.url}/v2/models/up/infer", json=_infer_body(rows), timeout=30)
    assert response.status_code == 200, response.text
    [output] = response.json()["outputs"]
    assert output["shape"] == [6]
    np.testing.assert_allclose(output["data"], rows.sum(axis=1))


def test_failed_items_are_reported_per_item_and_nothing_else_is_lost(server, upstream):
    poisoned_rows = np.ones((3, 4), dtype=np.float32)
    poisoned_rows[1, 0] = -503  # the upstream answers 503 for this row, every time

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            good = [client.post(f"{server.url}/v1/embeddings", json={"model": "up", "input": [f"ok {i}", "x"]})
                    for i in range(16)]
            bad_text = client.post(f"{server.url}/v1/embeddings",
                                   json={"model": "up", "input": ["fine", "status:400"]})
            bad_row = client.post(f"{server.url}/v2/models/up/infer", json=_infer_body(poisoned_rows))
            return list(await asyncio.gather(*good, bad_text, bad_row))

    *good, bad_text, bad_row = asyncio.run(scenario())
    assert [r.status_code for r in good] == [200] * 16
    for i, response in enumerate(good):
        np.testing.assert_allclose(response.json()["data"][0]["embedding"], expected_text_output(f"ok {i}"),
                                   rtol=1e-5)
    assert bad_text.status_code == 422
    assert "item 1: upstream rejected the item: HTTP 400" in bad_text.text
    assert bad_row.status_code == 503  # the upstream failed, not the input: worth retrying later
    assert "item 1: upstream failed after 2 attempts: HTTP 503" in bad_row.text
    assert "item 0" not in bad_row.text and "item 2" not in bad_row.text


def test_an_upstream_that_is_down_fails_fast_then_recovers(upstream, make_server, tmp_path):
    server = _serve(make_server, tmp_path, upstream.url, max_attempts=1, failure_threshold=3, open_s=1)
    upstream.fail_rate, upstream.fail_status = 1.0, 500
    for _ in range(3):
        assert _embed(server.url, ["x"]).status_code == 503
    response = _embed(server.url, ["y", "z"])
    assert response.status_code == 503 and "upstream unavailable: circuit open" in response.text
    assert response.headers["retry-after"] == "1"
    assert upstream.num_requests == 3, "the open circuit answers without calling the upstream"
    upstream.fail_rate = 0.0
    time.sleep(1.0)
    assert _embed(server.url, ["trial"]).status_code == 200
    assert _embed(server.url, ["a", "b", "c"]).status_code == 200


def _profile(metrics: str) -> tuple[float, float] | None:
    found = []
    for name in ("alpha", "beta"):
        pattern = rf'sluice_latency_profile_{name}_seconds\{{[^}}]*model="up"[^}}]*\}} ([0-9.e+-]+)'
        match = re.search(pattern, metrics)
        if match is None:
            return None
        found.append(float(match.group(1)))
    return found[0], found[1]


def test_latency_profile_learns_the_upstream_latency(server):
    """Batches of 1 to 4 items (the concurrency) each take one round of calls, about the
    upstream's 40 ms: the profile starts at the 200 ms prior and learns alpha ~ 40 ms, beta ~ 0."""
    # the worker's gauges reach the gateway with its next state report, a moment after it is ready
    eventually(lambda: _profile(httpx.get(f"{server.url}/metrics").text) is not None, "the profile's metrics")
    assert _profile(httpx.get(f"{server.url}/metrics").text) == pytest.approx((0.2, 0.0), abs=1e-3)
    for i in range(40):
        texts = [f"item {i} {j}" for j in range(1 + i % 4)]
        assert _embed(server.url, texts).status_code == 200
    deadline = time.monotonic() + 10
    profile = None
    while time.monotonic() < deadline:
        profile = _profile(httpx.get(f"{server.url}/metrics").text)
        if profile is not None and profile[0] < 0.1:
            break
        time.sleep(0.2)
    assert profile is not None, "profile metrics missing"
    alpha, beta = profile
    assert UPSTREAM_DELAY_S * 0.8 < alpha < 0.1, profile
    assert UPSTREAM_DELAY_S * 0.8 < alpha + 4 * beta < 0.1, profile


def test_two_workers_together_keep_the_upstreams_concurrency_limit(upstream: UpstreamServer, make_server,
                                                                   tmp_path: Path) -> None:
    """`concurrency = 4` is the upstream's limit, not each worker's: with `--workers 2` each
    worker takes 2 calls at most, so the upstream never sees more than 4 at once."""
    upstream.delay_s = 0.2
    model = tmp_path / "models" / "up"
    (model / "1").mkdir(parents=True)
    settings = {"concurrency": 4, "timeout_ms": 5000, "max_attempts": 1, "expected_latency_ms": 200}
    lines = ['kind = "http-single"', "[slo]", "default_ms = 30000", "[params]", f'url = "{upstream.url}"']
    (model / "model.toml").write_text("\n".join(lines + [f"{k} = {v}" for k, v in settings.items()]) + "\n")
    server = make_server(tmp_path / "models", "--workers", "2")

    async def flood() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            answers = await asyncio.gather(*(
                client.post(f"{server.url}/v1/embeddings", json={"model": "up", "input": f"text {i}"})
                for i in range(32)))
        return [answer.status_code for answer in answers]

    upstream.reset_counts()
    assert asyncio.run(flood()) == [200] * 32
    assert upstream.num_requests == 32
    assert 2 <= upstream.max_in_flight <= 4


@pytest.mark.parametrize(("num_slow_calls", "slow_s", "slo_ms"), [(1, 1.0, 500), (10, 0.6, 1500)],
                         ids=["one-slow-warm-up-call", "every-warm-up-call-slow"])
def test_a_fresh_model_whose_warm_up_ran_slow_takes_a_burst(make_server, tmp_path: Path, num_slow_calls: int,
                                                            slow_s: float, slo_ms: int):
    """The warm-up times calls to the upstream (`warmup_input`: rounds of 1, 4, 1 and 4 calls);
    the upstream was busy for the first of them, or for all ten (`slow_s` longer each), as a host
    busy loading or compiling makes a warm-up slow. A burst of 12 concurrent requests right after
    start, each with the model's deadline, is taken in full: the upstream answers in 20 ms. (Before,
    the profile fitted every warm-up timing as a batch, and 7 to 11 of the 12 were refused 503.)"""
    with UpstreamServer(delay_s=0.02) as upstream:
        upstream.slow_next, upstream.slow_s = num_slow_calls, slow_s
        model = tmp_path / "models" / "up"
        (model / "1").mkdir(parents=True)
        (model / "model.toml").write_text(
            f'kind = "http-single"\n[slo]\ndefault_ms = {slo_ms}\n[params]\nurl = "{upstream.url}"\n'
            "concurrency = 4\nexpected_latency_ms = 20\nwarmup_input = [1.0]\n")
        server = make_server(tmp_path / "models")
        assert upstream.num_requests == 10 and upstream.slow_next == 0  # warmed up, slow as planned
        body = _infer_body(np.ones((1, 1), dtype=np.float32))

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                return list(await asyncio.gather(*(client.post(f"{server.url}/v2/models/up/infer", json=body)
                                                   for _ in range(12))))

        answers = asyncio.run(burst())
        assert [answer.status_code for answer in answers] == [200] * 12, {answer.text for answer in answers}

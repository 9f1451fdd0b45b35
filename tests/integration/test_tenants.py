"""Tenants through a real server and the real `openai` SDK: 401, 403, 429 with OpenAI's headers,
budgets, classes, the admin scope, and a SIGHUP reload that drops nothing in flight."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import shutil
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from sluice.gateway.keyfile import add_key
from sluice.gateway.tenants import hash_key, new_key
from tests.conftest import eventually, free_port, write_emulated_model, write_tiny_lm_model

pytestmark = pytest.mark.slow

ROOMY = {"X-Request-Timeout-Ms": "30000"}

KEYS = {name: new_key() for name in ("alpha", "beta", "tiny", "tokens", "budget", "slow", "bulk", "stream", "single",
                                  "emoji", "prose", "one-at-a-time", "generate")}
ADMIN_KEY = new_key()
METRICS_KEY = new_key()

TENANTS = f"""
[admin]
api_keys = ["{hash_key(ADMIN_KEY)}"]

[metrics]
access = "keys"
api_keys = ["{hash_key(METRICS_KEY)}"]

[tenants.alpha]
api_keys = ["{hash_key(KEYS['alpha'])}"]
weight = 2
priority = "interactive"

[tenants.beta]
api_keys = ["{hash_key(KEYS['beta'])}"]
models = ["emulated"]

[tenants.tiny]
api_keys = ["{hash_key(KEYS['tiny'])}"]
requests_per_min = 60

[tenants.tokens]
api_keys = ["{hash_key(KEYS['tokens'])}"]
tokens_per_min = 100

[tenants.budget]
api_keys = ["{hash_key(KEYS['budget'])}"]
credits_device_s = 0.05
credit_period_s = 3600
models = ["slow"]

[tenants.slow]
api_keys = ["{hash_key(KEYS['slow'])}"]
tokens_per_min = 600
models = ["crawl"]

[tenants.bulk]
api_keys = ["{hash_key(KEYS['bulk'])}"]
priority = "batch"

[tenants.stream]
api_keys = ["{hash_key(KEYS['stream'])}"]
requests_per_min = 100
tokens_per_min = 5000

[tenants.single]
api_keys = ["{hash_key(KEYS['single'])}"]
max_concurrent = 1

[tenants.emoji]
api_keys = ["{hash_key(KEYS['emoji'])}"]
tokens_per_min = 1000
models = ["tiny-lm"]

[tenants.prose]
api_keys = ["{hash_key(KEYS['prose'])}"]
tokens_per_min = 100
models = ["emulated"]

[tenants.one-at-a-time]
api_keys = ["{hash_key(KEYS['one-at-a-time'])}"]
max_concurrent = 1

[tenants.generate]
api_keys = ["{hash_key(KEYS['generate'])}"]
requests_per_min = 2
models = ["tiny-lm"]
"""


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS)
    return path


@pytest.fixture(scope="module")
def grpc_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tenants_file: Path, grpc_port: int):
    from tests.conftest import start_server

    repo = tmp_path_factory.mktemp("repo")
    write_emulated_model(repo, "emulated")
    write_emulated_model(repo, "slow", alpha_ms=30, beta_ms=0.0)
    write_emulated_model(repo, "crawl", alpha_ms=1500, beta_ms=0.0, slo_ms=20000)
    write_tiny_lm_model(repo, "tiny-lm")
    started = start_server(repo, tmp_path_factory.mktemp("log"), "--tenants", str(tenants_file),
                           "--grpc-port", str(grpc_port))
    yield started
    started.stop()


def sdk(server, key: str | None, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key or "none", max_retries=retries, timeout=60,
                         default_headers=ROOMY)


def embed(server, tenant: str, model: str = "emulated", text: str = "hello world", retries: int = 0):
    with sdk(server, KEYS[tenant], retries) as client:
        return client.embeddings.with_raw_response.create(model=model, input=text)


def test_no_key_or_a_wrong_key_is_401(server):
    with sdk(server, None) as client, pytest.raises(openai.AuthenticationError) as caught:
        client.models.list()
    assert caught.value.status_code == 401
    assert caught.value.body["code"] == "invalid_api_key"  # type: ignore[index]
    response = httpx.post(f"{server.url}/v2/models/emulated/infer", json={"inputs": []})
    assert response.status_code == 401 and "error" in response.json()  # KServe's error shape


def scrape(server, key: str = METRICS_KEY) -> httpx.Response:
    return httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {key}"})


def test_health_needs_no_key_and_metrics_a_metrics_or_admin_key(server):
    """`[metrics] access = "keys"`: the tenants cannot read each other's names and usage."""
    assert httpx.get(f"{server.url}/v2/health/ready").status_code == 200
    anonymous = httpx.get(f"{server.url}/metrics")
    assert anonymous.status_code == 401 and "# HELP" not in anonymous.text
    assert anonymous.json()["error"]["code"] == "invalid_api_key"
    assert scrape(server, KEYS["alpha"]).status_code == 403
    assert scrape(server, new_key()).status_code == 401
    for key in (METRICS_KEY, ADMIN_KEY):
        answer = scrape(server, key)
        assert answer.status_code == 200 and "# HELP sluice_" in answer.text
    with sdk(server, METRICS_KEY) as client, pytest.raises(openai.PermissionDeniedError) as caught:
        client.embeddings.create(model="emulated", input="hi")  # a metrics key runs nothing
    assert caught.value.body["message"] == (  # type: ignore[index]
        "a metrics key reads /metrics and the model statistics, nothing else")


def test_a_metrics_key_elsewhere_is_403_for_what_it_may_not_do_not_401_not_valid(server):
    """A key that is valid but for something else: an operator told "the API key is not valid"
    would look for a typo in a key that is right."""
    metrics = {"Authorization": f"Bearer {METRICS_KEY}"}
    for method, path in (("GET", "/admin/tenants"), ("POST", "/admin/reload"), ("GET", "/v1/models"),
                         ("POST", "/v2/repository/models/emulated/load")):
        answer = httpx.request(method, f"{server.url}{path}", headers=metrics)
        assert answer.status_code == 403, (path, answer.text)
        error = answer.json()["error"]
        message = error if isinstance(error, str) else error["message"]
        assert message == "a metrics key reads /metrics and the model statistics, nothing else"


def test_model_statistics_need_a_metrics_or_admin_key_like_metrics_on_http_and_grpc(server, grpc_port):
    """They show every tenant's traffic: under `access = "keys"` a tenant's key may not read them."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    def stats(path: str, key: str | None) -> httpx.Response:
        return httpx.get(f"{server.url}{path}", headers={"Authorization": f"Bearer {key}"} if key else {})

    for path in ("/v2/models/stats", "/v2/models/emulated/stats", "/v2/models/emulated/versions/1/stats"):
        assert stats(path, None).status_code == 401
        assert stats(path, KEYS["beta"]).status_code == 403
        for key in (METRICS_KEY, ADMIN_KEY):
            assert stats(path, key).status_code == 200
    every = {s["name"] for s in stats("/v2/models/stats", METRICS_KEY).json()["model_stats"]}
    assert {"emulated", "slow", "crawl"} <= every
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for name in ("", "emulated"):
            request = service_pb2.ModelStatisticsRequest(name=name)
            with pytest.raises(grpc.RpcError) as caught:
                stub.ModelStatistics(request)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as caught:
                stub.ModelStatistics(request, metadata=(("authorization", f"Bearer {KEYS['beta']}"),))
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
            answer = stub.ModelStatistics(request, metadata=(("authorization", f"Bearer {METRICS_KEY}"),))
            assert {s.name for s in answer.model_stats} >= ({"emulated", "slow", "crawl"} if not name else {name})


def test_sluice_bench_reads_protected_metrics_with_its_metrics_key(server):
    from sluice.bench.loadgen import auth_headers, new_session
    from sluice.bench.promstats import scrape

    async def snapshots() -> tuple[object, object]:
        async with new_session(10.0, 4, auth_headers(KEYS["alpha"])) as session:  # the load's key
            return (await scrape(session, server.url, "emulated"),
                    await scrape(session, server.url, "emulated", headers=auth_headers(METRICS_KEY)))

    without, with_key = asyncio.run(snapshots())
    assert without is None and with_key is not None


def test_sluice_top_shows_each_tenant_with_a_metrics_key_and_says_when_it_needs_one(server):
    from tests.test_top import top_once

    refused = top_once(server.url, "--interval", "0.1")
    assert refused.returncode == 1 and "401" in refused.stderr and "--key" in refused.stderr
    import subprocess
    import sys

    live = subprocess.run([sys.executable, "-m", "sluice", "top", "--url", server.url, "--interval", "0.1", "--key",
                           KEYS["alpha"]], capture_output=True, text=True, timeout=60)  # as typed: no --once
    assert live.returncode == 1 and "answered 403" in live.stderr and "--key" in live.stderr
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        shown = pool.submit(top_once, server.url, "--json", "--interval", "1", "--key", METRICS_KEY)
        texts = (f"top {n}" for n in itertools.count())  # never the same: a cached answer uses no device
        while not shown.done():  # both tenants busy for as long as top watches
            embed(server, "alpha", text=next(texts))
            embed(server, "beta", text=next(texts))
        now = json.loads(shown.result().stdout)
    tenants = {row["tenant"]: row for row in now["tenants"]}
    assert tenants["alpha"]["priority_class"] == "interactive" and tenants["alpha"]["admitted_per_s"] > 0
    assert tenants["beta"]["priority_class"] == "standard" and tenants["beta"]["admitted_per_s"] > 0
    assert 0 < tenants["alpha"]["device_share"] < 1


def test_loading_models_needs_an_admin_key(server):
    url = f"{server.url}/v2/repository/models/emulated/load"
    assert httpx.post(url).status_code == 401
    refused = httpx.post(url, headers={"Authorization": f"Bearer {KEYS['alpha']}"})
    assert refused.status_code == 403 and "admin key" in refused.json()["error"]
    loaded = httpx.post(url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
    assert loaded.status_code == 200 and loaded.json() == {"name": "emulated", "versions": ["1"]}


def test_a_model_the_tenant_may_not_use_is_403_and_not_listed(server):
    with sdk(server, KEYS["beta"]) as client:
        assert [m.id for m in client.models.list().data] == ["emulated"]
        with pytest.raises(openai.PermissionDeniedError):
            client.embeddings.create(model="slow", input="hi")
        with pytest.raises(openai.PermissionDeniedError):
            client.models.retrieve("slow")
        assert client.embeddings.create(model="emulated", input="hi").data


def test_a_restricted_tenant_cannot_tell_a_forbidden_model_from_a_missing_one(server):
    with sdk(server, KEYS["beta"]) as client:
        for name in ("slow", "no-such-model"):  # one the server has, one it does not
            with pytest.raises(openai.PermissionDeniedError) as retrieved:
                client.models.retrieve(name)
            with pytest.raises(openai.PermissionDeniedError) as used:
                client.embeddings.create(model=name, input="hi")
            assert retrieved.value.body == used.value.body  # type: ignore[comparison-overlap]
            assert retrieved.value.body["code"] == "model_not_permitted"  # type: ignore[index]
    with sdk(server, KEYS["alpha"]) as client, pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")  # a tenant that may use every model learns it is missing


def test_requests_limit_answers_429_with_openai_headers_and_the_sdk_waits_it_out(server):
    first = embed(server, "tiny")
    assert first.headers["x-ratelimit-limit-requests"] == "60"
    assert int(first.headers["x-ratelimit-remaining-requests"]) == 59
    with pytest.raises(openai.RateLimitError) as caught:  # the bucket refills at one a second meanwhile
        for _ in range(120):
            embed(server, "tiny")
    headers = caught.value.response.headers
    assert caught.value.body["code"] == "requests_limit_exceeded"  # type: ignore[index]
    assert headers["retry-after"] == "1" and 0 < int(headers["retry-after-ms"]) <= 1000
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"].endswith(("ms", "s"))
    started = time.monotonic()
    assert embed(server, "tiny", retries=2).parse().data  # the SDK honours retry-after-ms, then succeeds
    assert time.monotonic() - started < 5


def test_a_one_request_tenant_can_send_its_next_request_the_moment_it_has_an_answer(server):
    """The gateway settles a request's accounting just after writing its answer
    (`gateway.ticket.defer_accounting`): by the time a client can send its next request, the
    concurrency slot is free and the metrics count the answer."""

    def goodput() -> float:
        text = scrape(server).text
        line = next((x for x in text.splitlines() if x.startswith("sluice_tenant_goodput_total{")
                     and 'tenant="single"' in x), None)
        return 0.0 if line is None else float(line.rsplit(" ", 1)[1])

    before = goodput()
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16}]}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEYS['single']}", **ROOMY}) as client:
        for i in range(60):
            body["inputs"][0]["data"][0] = float(i)  # a new input each time: not a cache hit
            response = client.post("/v2/models/emulated/infer", json=body)
            assert response.status_code == 200, response.text
    assert goodput() == before + 60


def test_kserve_generations_one_after_another_stay_within_a_concurrency_of_one(server, grpc_port):
    """A KServe generation (text_input on a generative model) never gave its tenant's concurrency
    slot back: a tenant limited to one request at a time got 429 on every request after its first."""
    import numpy as np
    import tritonclient.grpc as triton_grpc

    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Hello"]}],
            "parameters": {"max_tokens": 2}}
    auth = {"Authorization": f"Bearer {KEYS['one-at-a-time']}"}
    with httpx.Client(base_url=server.url, headers={**auth, **ROOMY}, timeout=60) as client:
        for _ in range(3):
            response = client.post("/v2/models/tiny-lm/infer", json=body)
            assert response.status_code == 200, response.text
    text = triton_grpc.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Hello"], dtype=np.object_))
    with triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}") as grpc_client:
        for _ in range(2):
            answer = grpc_client.infer("tiny-lm", [text], parameters={"max_tokens": 2},
                                       headers={"authorization": auth["Authorization"]})
            assert len(answer.as_numpy("text_output")) == 1


def test_tritons_generate_routes_answer_the_tenants_keys_and_limits_in_kserves_shape(server):
    """/generate and /generate_stream: no key 401, a model the key may not use 403, over the
    requests limit 429 with Retry-After, all as KServe's `{"error": ...}`; a stream carries the
    tenant's x-ratelimit-* headers as a whole answer does."""
    url = f"{server.url}/v2/models/tiny-lm"
    body = {"text_input": "Hi", "max_tokens": 2}
    for route in ("generate", "generate_stream"):
        unknown = httpx.post(f"{url}/{route}", json=body, timeout=60)
        assert unknown.status_code == 401 and "API key" in unknown.json()["error"]
        forbidden = httpx.post(f"{url}/{route}", json=body, timeout=60,
                               headers={"Authorization": f"Bearer {KEYS['beta']}"})
        assert forbidden.status_code == 403 and forbidden.json() == {
            "error": "this API key may not use the model 'tiny-lm'"}
    with httpx.Client(headers={"Authorization": f"Bearer {KEYS['generate']}", **ROOMY}, timeout=60) as client:
        whole = client.post(f"{url}/generate", json=body)
        assert whole.status_code == 200 and whole.headers["x-ratelimit-remaining-requests"] == "1"
        with client.stream("POST", f"{url}/generate_stream", json=body) as stream:
            assert stream.status_code == 200 and [line for line in stream.iter_lines() if line]
            assert stream.headers["x-ratelimit-limit-requests"] == "2"
            assert stream.headers["x-ratelimit-remaining-requests"] == "0"
        for route in ("generate", "generate_stream"):
            limited = client.post(f"{url}/{route}", json=body)
            assert limited.status_code == 429 and int(limited.headers["retry-after"]) > 0
            assert "requests per minute" in limited.json()["error"] and set(limited.json()) == {"error"}


def test_tokens_limit_refuses_without_consuming_a_request(server):
    with pytest.raises(openai.RateLimitError) as caught:  # 504 tokens reserved: over a whole minute's 100
        embed(server, "tokens", text="word " * 100, retries=2)
    assert caught.value.body["code"] == "tokens_limit_exceeded"  # type: ignore[index]
    assert "request too large" in caught.value.body["message"]  # type: ignore[index]
    assert caught.value.response.headers["x-should-retry"] == "false"  # so the SDK did not retry
    embed(server, "tokens", text="a " * 46)  # 96 tokens reserved, settled at the real 46
    with pytest.raises(openai.RateLimitError) as caught:
        embed(server, "tokens", text="b " * 40)  # 84 reserved: more than the 54 (and refill) left
    assert caught.value.body["code"] == "tokens_limit_exceeded"  # type: ignore[index]
    assert "request too large" not in caught.value.body["message"]  # type: ignore[index]
    assert 50 <= int(caught.value.response.headers["x-ratelimit-remaining-tokens"]) < 84


def test_a_text_whose_bound_exceeds_the_minute_but_whose_likely_count_fits_is_served(server):
    """200 characters of prose: bound 204 tokens (a token per byte), likely ~68, against 100 a
    minute. It waits for a full bucket rather than being refused for good; 500 characters (likely
    ~168) are too large."""
    answer = embed(server, "prose", text="word " * 40)
    assert answer.http_response.status_code == 200
    with pytest.raises(openai.RateLimitError) as caught:
        embed(server, "prose", text="word " * 100)
    assert "request too large" in caught.value.body["message"]  # type: ignore[index]


def test_concurrent_requests_cannot_overshoot_the_tokens_limit(server):
    """LiteLLM #18730: ten requests at once, each reserving a third of the minute's tokens, on a
    model slow enough that none completes (and settles) before the last arrives."""
    text = "x" * 196  # 200 tokens reserved each (a token per byte, 4 special); 600 per minute admit three

    def attempt(_: int) -> int:
        try:
            embed(server, "slow", model="crawl", text=text)
            return 200
        except openai.RateLimitError:
            return 429

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        outcomes = list(pool.map(attempt, range(10)))
    assert outcomes.count(200) == 3
    assert outcomes.count(429) == 7


def test_prompts_of_many_tokens_per_character_cannot_overshoot_the_tokens_limit(server):
    """Emoji (and digits, punctuation, CJK) take a token per byte or character, not one per three
    characters: twenty such prompts at once must not be admitted on a guess that undercounts them."""
    started = time.monotonic()

    def attempt(i: int) -> int:
        with sdk(server, KEYS["emoji"]) as client:
            try:
                completion = client.completions.create(model="tiny-lm", prompt="\N{GRINNING FACE}" * 50 + str(i),
                                                       max_tokens=1, extra_headers={"Cache-Control": "no-cache"})
            except openai.RateLimitError:
                return 0
            assert completion.usage is not None
            return completion.usage.total_tokens

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        used = list(pool.map(attempt, range(20)))
    assert any(used) and 0 in used
    refilled = (time.monotonic() - started) * 1000 / 60
    assert sum(used) <= 1000 + refilled, used


def test_a_spent_budget_is_429_insufficient_quota_and_not_retried(server):
    for i in range(2):  # 30 ms each against a 50 ms budget: the second is admitted, then overdraws
        embed(server, "budget", model="slow", text=f"spend {i}")  # distinct: a cached answer costs no credits
    with sdk(server, KEYS["budget"], retries=3) as client, pytest.raises(openai.RateLimitError) as caught:
        started = time.monotonic()
        client.embeddings.create(model="slow", input="one more")
    assert time.monotonic() - started < 2  # x-should-retry: false stops the SDK's retries
    assert caught.value.body["code"] == "insufficient_quota"  # type: ignore[index]
    assert caught.value.response.headers["x-should-retry"] == "false"
    # the hourly period ends on the hour (wall clock), whenever the server started
    to_the_hour_s = 3600 - time.time() % 3600
    assert abs(int(caught.value.response.headers["retry-after"]) - to_the_hour_s) < 5 or to_the_hour_s < 5


def test_a_request_may_lower_its_class_but_never_raise_it(server):
    embed(server, "bulk")  # default batch
    with sdk(server, KEYS["bulk"]) as client:
        client.embeddings.create(model="emulated", input="hi", extra_body={"service_tier": "priority"})
    with sdk(server, KEYS["alpha"]) as client:
        client.embeddings.create(model="emulated", input="hi", extra_body={"service_tier": "flex"})
        client.embeddings.create(model="emulated", input="hi")
    text = scrape(server).text
    assert 'sluice_tenant_admitted_total{class="batch",tenant="bulk"} 2.0' in text
    assert 'sluice_tenant_admitted_total{class="interactive",tenant="bulk"}' not in text
    assert 'sluice_tenant_admitted_total{class="batch",tenant="alpha"} 1.0' in text
    assert 'sluice_tenant_admitted_total{class="interactive",tenant="alpha"}' in text
    assert 'sluice_tenant_device_seconds_total{class="batch",tenant="bulk"}' in text
    assert 'sluice_tenant_queue_wait_seconds_count{class="interactive",tenant="alpha"}' in text


def test_admin_scope_is_separate_from_tenant_keys(server):
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    listing = httpx.get(f"{server.url}/admin/tenants", headers=admin)
    assert listing.status_code == 200
    assert {t["name"] for t in listing.json()["data"]} >= {"alpha", "beta", "budget"}
    budget = next(t for t in listing.json()["data"] if t["name"] == "budget")
    assert budget["limits"]["credits_device_s"] == 0.05 and budget["in_flight"] == 0
    assert budget["period_device_s"] <= budget["device_s"]
    tenant_try = httpx.get(f"{server.url}/admin/tenants", headers={"Authorization": f"Bearer {KEYS['alpha']}"})
    assert tenant_try.status_code == 403
    with sdk(server, ADMIN_KEY) as client, pytest.raises(openai.PermissionDeniedError):
        client.embeddings.create(model="emulated", input="hi")


def test_a_403_that_is_not_about_a_model_does_not_say_model_not_permitted(server):
    """The error code names the refusal: an admin key running inference, or a tenant's key on an
    admin route, is not a model the tenant may not use."""
    with sdk(server, ADMIN_KEY) as client, pytest.raises(openai.PermissionDeniedError) as admin_infers:
        client.embeddings.create(model="emulated", input="hi")
    assert admin_infers.value.body["code"] == "permission_denied"  # type: ignore[index]
    tenant_admins = httpx.post(f"{server.url}/admin/reload", headers={"Authorization": f"Bearer {KEYS['alpha']}"})
    assert tenant_admins.status_code == 403
    assert tenant_admins.json()["error"]["code"] == "permission_denied"
    with sdk(server, KEYS["beta"]) as client, pytest.raises(openai.PermissionDeniedError) as forbidden:
        client.embeddings.create(model="slow", input="hi")
    assert forbidden.value.body["code"] == "model_not_permitted"  # type: ignore[index]


def test_sighup_reloads_keys_without_dropping_requests_in_flight(server, tenants_file: Path):
    new = add_key(tenants_file, "gamma")
    with sdk(server, new) as client, pytest.raises(openai.AuthenticationError):
        client.models.list()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        running = [pool.submit(embed, server, "alpha", "crawl") for _ in range(8)]
        time.sleep(0.02)
        server.process.send_signal(signal.SIGHUP)
        assert all(f.result().status_code == 200 for f in running)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with sdk(server, new) as client:
                client.models.list()
            break
        except openai.AuthenticationError:
            time.sleep(0.1)
    else:
        pytest.fail("the new key was not accepted after SIGHUP")


def test_a_bad_reload_keeps_the_old_tenants_serving_and_says_so_in_a_log_line_and_a_metric(server,
                                                                                             tenants_file: Path):
    good = tenants_file.read_text()
    failed = 'sluice_tenants_reloads_total{outcome="failed"}'
    before = _sample(scrape(server).text, failed)
    try:
        tenants_file.write_text(good + "\n[tenants.typo]\nweigth = 2\n")
        server.process.send_signal(signal.SIGHUP)
        eventually(lambda: _sample(scrape(server).text, failed) == before + 1, "the failed reload counted")
        assert _sample(scrape(server).text, "sluice_tenants_reload_failed") == 1
        eventually(lambda: "tenants file not reloaded, the previous one stays in force" in server.log()
                   and "[tenants.typo]: unknown field(s) ['weigth']" in server.log(), "the failed reload logged")
        assert embed(server, "alpha").status_code == 200  # the old tenants still serve
        answer = httpx.post(f"{server.url}/admin/reload", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert answer.status_code == 400 and "weigth" in answer.json()["error"]["message"]
        assert _sample(scrape(server).text, failed) == before + 2  # the admin API's reload counts too
    finally:
        tenants_file.write_text(good)
    answer = httpx.post(f"{server.url}/admin/reload", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert answer.status_code == 200
    assert _sample(scrape(server).text, "sluice_tenants_reload_failed") == 0


def test_a_tenant_naming_a_model_the_repository_lacks_is_refused_at_start_and_on_reload(server, tenants_file: Path,
                                                                                        tmp_path: Path):
    import subprocess
    import sys

    typo = "\n[tenants.typo]\nmodels = ['emulatd']\n"
    bad = tmp_path / "tenants.toml"
    bad.write_text(TENANTS + typo)
    repo = tmp_path / "repo"
    for name in ("emulated", "slow", "crawl", "tiny-lm"):  # the models the other tenants name
        write_emulated_model(repo, name)
    started = subprocess.run([sys.executable, "-m", "sluice", "serve", "--models", str(repo), "--port", "0",
                              "--tenants", str(bad)], capture_output=True, text=True, timeout=120)
    assert started.returncode == 1
    assert started.stderr.strip() == (f"Error: {bad}: [tenants.typo] models: the model repository has no model "
                                      "'emulatd' (it has crawl, emulated, slow, tiny-lm)")

    good = tenants_file.read_text()
    try:
        tenants_file.write_text(good + typo)
        answer = httpx.post(f"{server.url}/admin/reload", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert answer.status_code == 400
        assert "[tenants.typo] models: the model repository has no model 'emulatd'" in answer.json()["error"]["message"]
        assert embed(server, "beta").status_code == 200  # the old tenants still serve
    finally:
        tenants_file.write_text(good)


def test_a_revoked_key_stops_working_at_the_reload_and_the_tenants_other_keys_go_on(server, tenants_file: Path):
    import subprocess
    import sys

    leaked, kept = add_key(tenants_file, "delta"), add_key(tenants_file, "delta")
    server.process.send_signal(signal.SIGHUP)
    eventually(lambda: httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {leaked}"})
               .status_code == 200, "the new keys taken")
    revoked = subprocess.run([sys.executable, "-m", "sluice", "keys", "revoke", leaked, "--tenants",
                              str(tenants_file)], capture_output=True, text=True, timeout=120)
    assert revoked.returncode == 0, revoked.stderr
    server.process.send_signal(signal.SIGHUP)
    eventually(lambda: httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {leaked}"})
               .status_code == 401, "the revoked key refused")
    with sdk(server, kept) as client:
        assert client.embeddings.create(model="emulated", input="hi").data


def test_a_stream_carries_the_tenants_rate_limit_headers(server):
    with sdk(server, KEYS["stream"]) as client, client.completions.with_streaming_response.create(
            model="tiny-lm", prompt="hi", max_tokens=3, stream=True) as response:
        headers = response.headers
        assert [line for line in response.iter_lines() if line][-1] == "data: [DONE]"
    assert headers["x-ratelimit-limit-requests"] == "100"
    assert int(headers["x-ratelimit-remaining-requests"]) == 99
    assert headers["x-ratelimit-limit-tokens"] == "5000"


def test_a_stored_response_is_its_tenants_alone(server):
    with sdk(server, KEYS["alpha"]) as alpha, sdk(server, KEYS["stream"]) as other:
        mine = alpha.responses.create(model="tiny-lm", input="Hi", max_output_tokens=2)
        assert alpha.responses.retrieve(mine.id).id == mine.id
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.input_items.list(mine.id)
        with pytest.raises(openai.NotFoundError) as refused:
            other.responses.create(model="tiny-lm", input="Hi", previous_response_id=mine.id, max_output_tokens=2)
        assert refused.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(mine.id)
        assert alpha.responses.retrieve(mine.id).output_text == mine.output_text

        # a background response runs as its tenant, in the class it asked for, and is its tenant's alone
        batch_class = 'sluice_tenant_admitted_total{class="batch",tenant="alpha"}'
        before = _sample(scrape(server).text, batch_class)
        queued = alpha.responses.create(model="tiny-lm", input="Hi", max_output_tokens=2, background=True,
                                        service_tier="flex")
        with pytest.raises(openai.NotFoundError):
            other.responses.cancel(queued.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(queued.id)
        eventually(lambda: alpha.responses.retrieve(queued.id).status == "incomplete", "the background response")
        assert _sample(scrape(server).text, batch_class) == before + 1


def _sample(exposition: str, series: str) -> float:
    found = [line.split()[-1] for line in exposition.splitlines() if line.startswith(series + " ")]
    return float(found[0]) if found else 0.0


def test_without_a_tenants_file_the_one_tenant_is_named_as_the_metrics_name_it(demo_server):
    listing = httpx.get(f"{demo_server.url}/admin/tenants", timeout=30)
    assert listing.status_code == 200, listing.text
    assert [t["name"] for t in listing.json()["data"]] == ["local"]
    reloaded = httpx.post(f"{demo_server.url}/admin/reload", timeout=30)
    assert reloaded.json() == {"reloaded": False, "tenants": ["local"]}


def _publish_secret(volume: Path, version: str, body: str) -> None:
    """What the kubelet does when a Secret volume's Secret changes: `tenants.toml` ->
    `..data/tenants.toml`, `..data` -> a folder named by time, swapped for a new one (the old one
    is deleted after)."""
    import os

    folder = volume / f"..{version}"
    folder.mkdir(parents=True)
    (folder / "tenants.toml").write_text(body)
    (volume / "..data_tmp").symlink_to(folder.name)
    os.replace(volume / "..data_tmp", volume / "..data")
    if not (volume / "tenants.toml").is_symlink():
        (volume / "tenants.toml").symlink_to("..data/tenants.toml")


def test_a_tenants_file_in_a_kubernetes_secret_volume_reloads_after_the_secret_changes(make_server, emulated_repo,
                                                                                       tmp_path: Path):
    volume = tmp_path / "etc-sluice"
    first_key, second_key = new_key(), new_key()

    def publish(version: str, key: str) -> None:
        _publish_secret(volume, version, f'[tenants.acme]\napi_keys = ["{hash_key(key)}"]\n')

    publish("2026_11_27_10_00_00.1", first_key)
    server = make_server(emulated_repo(alpha_ms=1.0, beta_ms=0.1), "--tenants", str(volume / "tenants.toml"))
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {first_key}"}).status_code == 200

    publish("2026_11_27_10_05_00.2", second_key)  # the first key revoked in the Secret
    shutil.rmtree(volume / "..2026_11_27_10_00_00.1")
    server.process.send_signal(signal.SIGHUP)
    eventually(lambda: httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {second_key}"})
               .status_code == 200, "the Secret's new key taken")
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {first_key}"}).status_code == 401
    assert "not reloaded" not in server.log()


def test_with_poll_tenants_a_changed_secret_applies_on_its_own_and_a_bad_one_is_counted_once(make_server,
                                                                                             emulated_repo,
                                                                                             tmp_path: Path):
    """Behind a Service, `POST /admin/reload` reaches one gateway and SIGHUP needs an exec into
    each pod: with `--poll-tenants` every gateway follows the Secret."""
    volume = tmp_path / "etc-sluice"
    first_key, second_key, admin_key = new_key(), new_key(), new_key()
    admin = f'[admin]\napi_keys = ["{hash_key(admin_key)}"]\n'
    _publish_secret(volume, "1", admin + f'[tenants.acme]\napi_keys = ["{hash_key(first_key)}"]\n')
    server = make_server(emulated_repo(alpha_ms=1.0, beta_ms=0.1), "--tenants", str(volume / "tenants.toml"),
                         "--poll-tenants", "0.2")

    def status(key: str) -> int:
        return httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code

    assert status(first_key) == 200
    _publish_secret(volume, "2", admin + f'[tenants.acme]\napi_keys = ["{hash_key(second_key)}"]\n')
    eventually(lambda: status(second_key) == 200 and status(first_key) == 401, "the Secret's change applied")

    _publish_secret(volume, "3", admin + "[tenants.acme]\nweigth = 2\n")
    failed = 'sluice_tenants_reloads_total{outcome="failed"}'
    metrics = {"Authorization": f"Bearer {admin_key}"}
    eventually(lambda: _sample(httpx.get(f"{server.url}/metrics", headers=metrics).text, failed) == 1,
               "the bad file counted")
    time.sleep(1.0)  # five more looks at the same bad file
    assert _sample(httpx.get(f"{server.url}/metrics", headers=metrics).text, failed) == 1
    assert server.log().count("tenants file not reloaded") == 1
    assert status(second_key) == 200  # the tenants before it still serve

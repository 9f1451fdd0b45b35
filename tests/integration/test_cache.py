"""The result cache through real servers and real clients: repeated and concurrent identical
requests are answered without the device, per tenant, shared between gateways through Redis."""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import redis
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton

from sluice.gateway.tenants import hash_key, new_key
from sluice.repository import demo_repository
from tests.conftest import ServerProcess, free_port, metric_total, write_emulated_model, write_tiny_lm_model

pytestmark = pytest.mark.slow


def _items_run(server: ServerProcess, model: str = "emulated") -> float:
    """Items that went through a batch on a device."""
    return metric_total(server, "sluice_batch_size_sum", model=model)


def _infer_body(*values: float) -> dict[str, object]:
    return {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, len(values)], "data": list(values)}]}


def test_the_openai_sdk_gets_a_repeated_embedding_from_the_cache(demo_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{demo_server.url}/v1", api_key="unused")
    sentence = f"a sentence seen twice {uuid.uuid4().hex}"
    first = client.embeddings.with_raw_response.create(model="minilm", input=[sentence])
    items = _items_run(demo_server, "minilm")
    second = client.embeddings.with_raw_response.create(model="minilm", input=[sentence],
                                                        encoding_format="float")
    assert first.headers.get("x-sluice-cache") is None and second.headers.get("x-sluice-cache") == "hit"
    assert _items_run(demo_server, "minilm") == items  # the device did not see it again
    a, b = first.parse(), second.parse()
    assert a.data[0].embedding == pytest.approx(b.data[0].embedding, abs=1e-6)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens > 0
    assert metric_total(demo_server, "sluice_cache_lookups_total", model="minilm", result="hit") >= 1


def test_embeddings_share_an_entry_across_routes_that_parse_them_and_dimensions_only_checks(
        make_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    """As the README's Result cache says: the key of an embeddings request and of a gRPC infer is
    the parsed texts (so they share an entry), `dimensions` and `encoding_format` are not part of
    it, and a KServe infer over HTTP is keyed by its body as sent (another entry)."""
    repo = tmp_path / "repo"
    shutil.copytree(demo_repository() / "minilm", repo / "minilm")
    grpc_port = free_port()
    server = make_server(repo, "--grpc-port", str(grpc_port))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    texts = [f"shared between routes {uuid.uuid4().hex}", "and a second text"]
    first = client.embeddings.with_raw_response.create(model="minilm", input=texts, encoding_format="float")
    assert first.headers.get("x-sluice-cache") is None
    items = _items_run(server, "minilm")
    again = client.embeddings.with_raw_response.create(model="minilm", input=texts, dimensions=384)
    assert again.headers.get("x-sluice-cache") == "hit"
    with pytest.raises(openai.BadRequestError) as shortened:  # refused before inference: no device time
        client.embeddings.create(model="minilm", input=[f"never run {uuid.uuid4().hex}"], dimensions=128)
    assert shortened.value.param == "dimensions" and "384" in shortened.value.message
    with triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}") as grpc_client:
        tensor = triton_grpc.InferInput("text", [2], "BYTES")
        tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
        by_grpc = grpc_client.infer("minilm", [tensor]).as_numpy("embedding")
    assert _items_run(server, "minilm") == items  # the gRPC request was the same entry
    np.testing.assert_allclose(by_grpc, [d.embedding for d in first.parse().data], atol=1e-6)
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": texts}]}
    by_http = httpx.post(f"{server.url}/v2/models/minilm/infer", json=body, timeout=60)
    assert by_http.status_code == 200 and by_http.headers.get("x-sluice-cache") is None
    assert _items_run(server, "minilm") == items + 2  # keyed by its body: run


def test_identical_requests_in_flight_run_once(make_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    server = make_server(write_emulated_model(tmp_path / "repo", alpha_ms=400))

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(*(client.post(f"{server.url}/v2/models/emulated/infer",
                                                      json=_infer_body(1, 2, 3)) for _ in range(8)))

    answers = asyncio.run(send_all())
    assert [a.status_code for a in answers] == [200] * 8
    assert {a.json()["outputs"][0]["data"][0] for a in answers} == {6.0}
    assert sorted(a.headers.get("x-sluice-cache", "") for a in answers) == [""] + ["coalesced"] * 7
    assert _items_run(server) == 1


def test_tritonclient_requests_honour_cache_control(make_server: Callable[..., ServerProcess],
                                                   tmp_path: Path) -> None:
    server = make_server(write_emulated_model(tmp_path / "repo"))
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    data = np.array([[1.5, 2.5, 4.0]], dtype=np.float32)

    def infer(**headers: str) -> float:
        tensor = triton.InferInput("INPUT0", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        return float(client.infer("emulated", [tensor], headers=headers).as_numpy("OUTPUT0")[0])

    def lookups(result: str) -> float:
        return metric_total(server, "sluice_cache_lookups_total", model="emulated", result=result)

    assert [infer(), infer(), infer()] == [8.0] * 3
    assert (_items_run(server), lookups("miss"), lookups("hit")) == (1, 1, 2)
    assert infer(**{"Cache-Control": "no-store"}) == 8.0  # run, and the cache not even looked at
    assert (_items_run(server), lookups("miss"), lookups("hit")) == (2, 1, 2)
    assert infer(**{"Cache-Control": "no-cache"}) == 8.0  # run, and its answer stored
    assert (_items_run(server), lookups("miss"), lookups("hit")) == (3, 2, 2)


def test_a_stored_answer_is_served_while_new_requests_are_refused(make_server: Callable[..., ServerProcess],
                                                                  tmp_path: Path) -> None:
    server = make_server(write_emulated_model(tmp_path / "repo", slo_ms=500, max_batch_size=1, alpha_ms=400))
    infer = f"{server.url}/v2/models/emulated/infer"

    async def overload() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            assert (await client.post(infer, json=_infer_body(1, 1))).status_code == 200  # stored
            running = asyncio.create_task(client.post(infer, json=_infer_body(2, 2)))
            await asyncio.sleep(0.15)  # its 400 ms batch runs: nothing else can finish within 500 ms now
            stored = await client.post(infer, json=_infer_body(1, 1))
            new = await client.post(infer, json=_infer_body(3, 3))
            return stored, new, await running

    stored, new, running = asyncio.run(overload())
    assert new.status_code == 503 and "retry-after" in new.headers
    assert stored.status_code == 200 and stored.headers.get("x-sluice-cache") == "hit"
    assert stored.json()["outputs"][0]["data"] == [2.0] and running.status_code == 200


def test_a_model_can_turn_the_cache_off(make_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    repo = write_emulated_model(tmp_path / "repo")
    with (repo / "emulated" / "model.toml").open("a") as toml:
        toml.write("[cache]\nenabled = false\n")
    server = make_server(repo)
    answers = [httpx.post(f"{server.url}/v2/models/emulated/infer", json=_infer_body(1, 2)) for _ in range(2)]
    assert [a.headers.get("x-sluice-cache") for a in answers] == [None, None]
    assert _items_run(server) == 2


def test_tenants_never_get_each_others_answers(make_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    keys = {"alpha": new_key(), "beta": new_key()}
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("".join(f'[tenants.{name}]\napi_keys = ["{hash_key(key)}"]\n' for name, key in keys.items()))
    server = make_server(write_emulated_model(tmp_path / "repo"), "--tenants", str(tenants))

    def infer(tenant: str) -> httpx.Response:
        return httpx.post(f"{server.url}/v2/models/emulated/infer", json=_infer_body(7, 8),
                          headers={"Authorization": f"Bearer {keys[tenant]}"})

    def used(tenant: str, metric: str) -> float:
        return metric_total(server, f"sluice_tenant_{metric}_total", tenant=tenant)

    sources = [infer(tenant).headers.get("x-sluice-cache") for tenant in ("alpha", "beta")]
    device_s = {tenant: used(tenant, "device_seconds") for tenant in keys}
    sources += [infer(tenant).headers.get("x-sluice-cache") for tenant in ("alpha", "beta")]
    assert sources == [None, None, "hit", "hit"]
    assert _items_run(server) == 2
    for tenant in keys:  # a hit is a success for its tenant, paid with no device time
        assert device_s[tenant] > 0 and used(tenant, "device_seconds") == device_s[tenant]
        assert used(tenant, "goodput") == 2


def test_greedy_completions_are_cached_and_sampled_ones_are_not(make_server: Callable[..., ServerProcess],
                                                                tmp_path: Path) -> None:
    server = make_server(write_tiny_lm_model(tmp_path / "repo"))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")

    def complete(**sampling: float) -> tuple[str | None, str, int]:
        raw = client.completions.with_raw_response.create(model="tiny", prompt="once upon a time", max_tokens=8,
                                                          **sampling)
        answer = raw.parse()
        return raw.headers.get("x-sluice-cache"), answer.choices[0].text, answer.usage.completion_tokens

    first = complete(temperature=0)
    generated = metric_total(server, "sluice_generation_tokens_total", model="tiny")
    again = complete(temperature=0)
    assert first[0] is None and again == ("hit", first[1], first[2])
    assert metric_total(server, "sluice_generation_tokens_total", model="tiny") == generated  # none made for it
    assert [complete(temperature=1.0, seed=1)[0] for _ in range(2)] == [None, None]
    for _ in range(2):  # a stream is made as it is sent, never answered from the cache
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, temperature=0, stream=True)
        assert len([chunk for chunk in stream if chunk.choices]) >= 2
    assert metric_total(server, "sluice_cache_lookups_total", model="tiny", result="hit") == 1


def test_gateways_share_answers_through_redis(make_server: Callable[..., ServerProcess], tmp_path: Path,
                                              redis_url: str) -> None:
    repo = write_emulated_model(tmp_path / "repo")
    first, second = (make_server(repo, "--cache-redis", redis_url) for _ in range(2))
    body = _infer_body(float(uuid.uuid4().int % 1000), 0.25)
    shared = redis.Redis.from_url(redis_url)
    stored = len(shared.keys("sluice:cache:*"))
    assert httpx.post(f"{first.url}/v2/models/emulated/infer", json=body).headers.get("x-sluice-cache") is None
    deadline = time.monotonic() + 5
    while len(shared.keys("sluice:cache:*")) == stored and time.monotonic() < deadline:
        time.sleep(0.01)  # the answer is written to Redis after it is sent
    answer = httpx.post(f"{second.url}/v2/models/emulated/infer", json=body)
    assert answer.status_code == 200 and answer.headers.get("x-sluice-cache") == "hit"
    assert _items_run(second) == 0 and _items_run(first) == 1


def test_a_cached_answer_adds_no_queue_wait_to_its_tenants_metrics(make_server: Callable[..., ServerProcess],
                                                                     tmp_path: Path) -> None:
    """A cache hit was observed as a 0 s wait in `sluice_tenant_queue_wait_seconds`: with half the
    answers cached, the tenant's median queue wait read 0 whatever its requests really waited."""
    server = make_server(write_emulated_model(tmp_path / "repo", alpha_ms=5))
    for _ in range(3):
        answer = httpx.post(f"{server.url}/v2/models/emulated/infer", json=_infer_body(4, 3, 2, 1))
        assert answer.status_code == 200
    assert answer.headers["x-sluice-cache"] == "hit"
    assert metric_total(server, "sluice_tenant_goodput_total", tenant="local") == 3
    assert metric_total(server, "sluice_tenant_queue_wait_seconds_count", tenant="local") == 1

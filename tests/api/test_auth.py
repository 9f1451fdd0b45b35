"""A request must present its API key once: two `Authorization` headers, two `api-key`, or the two
naming different keys are refused (400, in the route's protocol's error shape), never served as
one of them. Through a real server on a loopback port (the gateway in-process, no workers)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import uvicorn
from tritonclient.grpc import service_pb2, service_pb2_grpc

from sluice.api.app import build_app
from sluice.api.http_protocol import stamping_protocol
from sluice.api.kserve_grpc import start_server
from sluice.clock import MonotonicClock
from sluice.gateway import Gateway
from sluice.gateway.keyfile import add_key
from sluice.gateway.tenancy import Tenancy
from sluice.metrics import GatewayMetrics
from tests.conftest import free_port


def _gateway(tmp_path: Path) -> tuple[Gateway, str, str]:
    """A gateway with tenants `a` and `b` (both may use `allowed`, not served yet), and their keys."""
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.a]\nmodels = ['allowed']\n[tenants.b]\nmodels = ['allowed']\n")
    key_a, key_b = add_key(path, "a"), add_key(path, "b")
    clock, metrics = MonotonicClock(), GatewayMetrics()
    gateway = Gateway(clock, metrics, tenancy=Tenancy(clock, metrics, path))
    gateway.expected_versions = {("allowed", "1")}
    return gateway, key_a, key_b


@contextlib.contextmanager
def _serving(gateway: Gateway) -> Iterator[str]:
    """The app on a loopback port, with the HTTP protocol `sluice serve` uses; yields its URL."""
    app = build_app(gateway)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, loop="asyncio", log_config=None,
                                           lifespan="off", http=stamping_protocol(MonotonicClock(), app.answer_early)))
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server did not start")
            thread.join(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join()


INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}


def test_a_key_presented_twice_or_two_different_keys_are_refused_in_the_routes_error_shape(tmp_path: Path):
    gateway, key_a, key_b = _gateway(tmp_path)
    twice = [("authorization", f"Bearer {key_a}"), ("authorization", f"Bearer {key_b}")]
    both_named = [("authorization", f"Bearer {key_a}"), ("api-key", key_b)]
    api_key_twice = [("api-key", key_a), ("api-key", key_a)]
    with _serving(gateway) as url, httpx.Client(base_url=url) as client:
        for headers in (twice, both_named, api_key_twice):
            listed = client.get("/v1/models", headers=headers)  # the middleware's path
            assert listed.status_code == 400, listed.text
            error = listed.json()["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "invalid_request"
            assert "key" in error["message"]
            embedded = client.post("/v1/embeddings", json={"model": "allowed", "input": "hi"}, headers=headers)
            assert embedded.status_code == 400 and embedded.json()["error"]["code"] == "invalid_request"  # early answer
            inferred = client.post("/v2/models/allowed/infer", json=INFER, headers=headers)
            assert inferred.status_code == 400 and isinstance(inferred.json()["error"], str)  # KServe's shape
            assert client.get("/metrics", headers=headers).status_code == 400
        # one key, or the same key in both headers (as some clients send it), is that tenant's
        for headers in ([("authorization", f"Bearer {key_a}")], [("authorization", f"Bearer {key_a}"),
                                                                  ("api-key", key_a)]):
            assert client.get("/v1/models", headers=headers).status_code == 200


def test_the_openai_sdk_given_a_key_and_another_in_an_api_key_header_is_told_why(tmp_path: Path):
    gateway, key_a, key_b = _gateway(tmp_path)
    with _serving(gateway) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key_a, default_headers={"api-key": key_b},
                               max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            client.models.list()
    assert "different API keys" in caught.value.message


def test_grpc_metadata_presenting_two_keys_is_invalid_argument(tmp_path: Path):
    gateway, key_a, key_b = _gateway(tmp_path)

    async def codes() -> list[grpc.StatusCode | None]:
        server, port = await start_server(gateway, "127.0.0.1", 0, 1 << 20)
        found: list[grpc.StatusCode | None] = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
                for metadata in ((("authorization", f"Bearer {key_a}"), ("authorization", f"Bearer {key_b}")),
                                 (("authorization", f"Bearer {key_a}"),)):
                    try:
                        await stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(), metadata=metadata)
                        found.append(None)
                    except grpc.aio.AioRpcError as exc:
                        found.append(exc.code())
        finally:
            await server.stop(0)
        return found

    assert asyncio.run(codes()) == [grpc.StatusCode.INVALID_ARGUMENT, None]


def test_a_route_that_does_not_exist_is_404_in_its_protocols_shape_for_every_valid_key(tmp_path: Path):
    """A path no route has is 404 for any valid key: a tenant's, or the admin's (which used to get
    403 "cannot run inference" on /v1 and /v2 paths, as if the route were there and only its key
    wrong), and a tenant's on an `/admin/...` path no route has (403 "needs an admin key" before).
    The key is checked first: no key or an unknown key is still 401, so that a caller without a
    key learns nothing about the routes. A route that exists keeps its 403 for the wrong key."""
    gateway, key_a, _ = _gateway(tmp_path)
    admin_key = add_key(tmp_path / "tenants.toml", None)
    gateway.tenancy.reload()
    admin = {"authorization": f"Bearer {admin_key}"}
    tenant = {"authorization": f"Bearer {key_a}"}
    with _serving(gateway) as url, httpx.Client(base_url=url) as client:
        for headers in (admin, tenant):
            for method, path in (("GET", "/v1/nope"), ("POST", "/v1/nope/completions"),
                                 ("POST", "/v2/models/x/nonsense"), ("GET", "/v2/nope"), ("GET", "/admin/nope")):
                answer = client.request(method, path, headers=headers, json={})
                assert answer.status_code == 404, (headers is admin, method, path, answer.text)
                error = answer.json()["error"]
                if path.startswith("/v2/"):
                    assert isinstance(error, str) and path in error  # KServe's shape
                else:
                    assert error["code"] == "not_found" and path in error["message"]
        for headers in ({}, {"authorization": "Bearer not-a-key"}):
            assert client.get("/v1/nope", headers=headers).status_code == 401
            assert client.post("/v2/models/x/nonsense", headers=headers, json={}).status_code == 401
        # routes that are there still refuse the wrong kind of key
        assert client.get("/v1/models", headers=admin).status_code == 403
        assert client.post("/admin/reload", headers=tenant).status_code == 403


def test_the_openai_sdk_with_an_admin_key_on_a_missing_route_gets_not_found(tmp_path: Path):
    gateway, _, _ = _gateway(tmp_path)
    admin_key = add_key(tmp_path / "tenants.toml", None)
    gateway.tenancy.reload()
    with _serving(gateway) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=admin_key, max_retries=0)
        with pytest.raises(openai.NotFoundError) as caught:
            client.get("/nope", cast_to=object)
    assert "/v1/nope" in caught.value.message

"""While the workers start, a tenant asking for a model it may not use is told 403, not 503
"no ready worker yet": over HTTP (KServe and /v1) and gRPC, in-process on a gateway with none ready."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from starlette.testclient import TestClient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from sluice.api.app import build_app
from sluice.api.kserve_grpc import start_server
from sluice.clock import VirtualClock
from sluice.gateway import Gateway
from sluice.gateway.keyfile import add_key
from sluice.gateway.tenancy import Tenancy
from sluice.metrics import GatewayMetrics


def starting_gateway(tmp_path: Path) -> tuple[Gateway, str]:
    """A gateway whose repository has `allowed` and `secret`, neither served yet; and the key of
    a tenant that may use `allowed` only."""
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.a]\nmodels = ['allowed']\n")
    key = add_key(path, "a")
    clock, metrics = VirtualClock(), GatewayMetrics()
    gateway = Gateway(clock, metrics, tenancy=Tenancy(clock, metrics, path))
    gateway.expected_versions = {("allowed", "1"), ("secret", "1")}
    return gateway, key


def test_http_answers_a_forbidden_model_403_before_saying_none_is_ready(tmp_path: Path):
    gateway, key = starting_gateway(tmp_path)
    client = TestClient(build_app(gateway), raise_server_exceptions=False)
    headers = {"authorization": f"Bearer {key}"}
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}
    for model, status in (("secret", 403), ("allowed", 503)):
        assert client.post(f"/v2/models/{model}/infer", json=body, headers=headers).status_code == status
        assert client.post("/v1/embeddings", json={"model": model, "input": "hi"},
                           headers=headers).status_code == status
        assert client.post("/v1/chat/completions", headers=headers, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}]}).status_code == status
    assert client.get("/v2/models/secret", headers=headers).status_code == 403


def test_grpc_answers_a_forbidden_model_permission_denied_before_unavailable(tmp_path: Path):
    gateway, key = starting_gateway(tmp_path)

    async def codes() -> list[grpc.StatusCode]:
        server, port = await start_server(gateway, "127.0.0.1", 0, 1 << 20)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
                found = []
                for model in ("secret", "allowed"):
                    request = service_pb2.ModelInferRequest(model_name=model)
                    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 1]).contents.fp32_contents.append(1.0)
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await stub.ModelInfer(request, metadata=(("authorization", f"Bearer {key}"),))
                    found.append(caught.value.code())
                return found
        finally:
            await server.stop(None)

    assert asyncio.run(codes()) == [grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAVAILABLE]

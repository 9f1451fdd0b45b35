"""A client deadline the model cannot meet is answered 504 at once, and does not harm the server."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from tests.conftest import free_port, metric_total, write_emulated_model

BODY = {"inputs": [{"name": "INPUT0", "shape": [2, 8], "datatype": "FP32", "data": [1.0] * 16}]}
# Longer than the worker's state interval, so the gateway sees an idle device again: it counts
# requests sent since the last state report as queued work, and answers 503 (overloaded) to a
# 1 ms deadline while any are counted.
SETTLE_S = 0.2


def test_deadline_shorter_than_execution_is_504_and_next_request_succeeds(make_server, emulated_repo):
    server = make_server(emulated_repo(alpha_ms=50))
    with httpx.Client(base_url=server.url, timeout=30) as client:
        started = time.monotonic()
        late = client.post("/v2/models/emulated/infer", json=BODY, headers={"X-Request-Timeout-Ms": "1"})
        assert late.status_code == 504, late.text
        assert "deadline" in late.json()["error"]
        assert late.headers["x-request-id"]
        assert time.monotonic() - started < 1.0  # refused up front, not after waiting on the device

        time.sleep(SETTLE_S)
        late_v1 = client.post(
            "/v1/embeddings", json={"model": "emulated", "input": "hi"}, headers={"X-Request-Timeout-Ms": "1"}
        )
        assert late_v1.status_code == 504
        assert late_v1.json()["error"]["code"] == "deadline_exceeded"

        ok = client.post("/v2/models/emulated/infer", json=BODY)
        assert ok.status_code == 200
        assert ok.json()["outputs"][0]["data"] == [8.0, 8.0]
        roomy = client.post("/v2/models/emulated/infer", json=BODY, headers={"X-Request-Timeout-Ms": "5000"})
        assert roomy.status_code == 200


def test_a_request_of_many_batches_without_a_deadline_gets_the_slo_for_each_batch(make_server, emulated_repo):
    """320 rows are 10 batches of 32 (240 ms of device time), far over the model's 90 ms SLO:
    without a client deadline the request gets 10 SLOs and is answered, not refused."""
    server = make_server(emulated_repo(slo_ms=90))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    texts = [f"text {i}" for i in range(320)]
    answer = client.embeddings.create(model="emulated", input=texts)
    assert [item.index for item in answer.data] == list(range(320))
    rows = {"inputs": [{"name": "INPUT0", "shape": [320, 16], "datatype": "FP32", "data": [1.0] * 320 * 16}]}
    with httpx.Client(base_url=server.url, timeout=30, headers={"Cache-Control": "no-store"}) as http:
        ok = http.post("/v2/models/emulated/infer", json=rows)
        assert ok.status_code == 200, ok.text
        assert ok.json()["outputs"][0]["data"] == [16.0] * 320
        # A deadline the client sets is its own: one shorter than the request's own batches is
        # refused at once, and told not to retry (the openai SDK retries a 504 unless told).
        short = http.post("/v2/models/emulated/infer", json=rows, headers={"X-Request-Timeout-Ms": "100"})
        assert short.status_code == 504
        assert short.headers["x-should-retry"] == "false"
        assert "X-Request-Timeout-Ms" in short.json()["error"]


def test_metrics_say_whose_deadline_a_504_missed(make_server, emulated_repo):
    """`sluice_requests_total{outcome="expired"}` cannot tell a model missing its SLO from a client
    whose own timeout is too short for one batch; the deadlines alert must not page for the
    latter. `sluice_expired_requests_total{deadline}` tells them apart.

    A tenant's request admitted past its limits that then missed its deadline was counted in
    `sluice_tenant_rejected_total{reason="expired"}` too: admitted plus refused came to more than
    the requests sent. It is counted as admitted only."""
    server = make_server(emulated_repo(alpha_ms=50, slo_ms=20))  # one batch takes longer than the SLO
    with httpx.Client(base_url=server.url, timeout=30, headers={"Cache-Control": "no-store"}) as client:
        mine = client.post("/v2/models/emulated/infer", json=BODY, headers={"X-Request-Timeout-Ms": "1"})
        assert mine.status_code == 504
        time.sleep(SETTLE_S)
        slo = client.post("/v2/models/emulated/infer", json=BODY)
        assert slo.status_code == 504
    assert metric_total(server, "sluice_requests_total", outcome="expired") == 2
    assert metric_total(server, "sluice_expired_requests_total", deadline="client") == 1
    assert metric_total(server, "sluice_expired_requests_total", deadline="slo") == 1
    admitted = metric_total(server, "sluice_tenant_admitted_total")
    refused = metric_total(server, "sluice_tenant_rejected_total")
    assert admitted + refused == 2
    assert admitted >= 1  # the second: sent on to the worker, which found its SLO too short


WORDS = 512
"""Words of each text (the emulated model's cost of a text) and values of each row: 32 of them
fill one batch by count (32) but two by cost (8,192 a batch), each batch 8 + 0.5 * 8192 / 16 =
264 ms, under the model's SLO of 300 ms; both batches are over it."""


def test_a_request_of_many_batches_by_its_cost_gets_the_slo_for_each_and_is_still_shed_when_busy(
        tmp_path: Path, make_server) -> None:
    repo = write_emulated_model(tmp_path / "models", slo_ms=300, alpha_ms=8.0, beta_ms=0.5)
    grpc_port = free_port()
    server = make_server(repo, "--grpc-port", str(grpc_port))
    no_cache = {"Cache-Control": "no-store"}
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, default_headers=no_cache)
    grpc_client = triton.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    texts = [f"{i} " + "w " * (WORDS - 1) for i in range(32)]
    answer = sdk.embeddings.create(model="emulated", input=texts)
    assert len(answer.data) == 32
    with httpx.Client(base_url=server.url, timeout=30, headers=no_cache) as http:
        ok = http.post("/v2/models/emulated/infer", json=_rows_body(32, WORDS))
        assert ok.status_code == 200, ok.text
        assert ok.json()["outputs"][0]["data"] == [float(WORDS)] * 32
        tensor = triton.InferInput("INPUT0", [32, WORDS], "FP32")
        tensor.set_data_from_numpy(np.ones((32, WORDS), np.float32))
        by_grpc = grpc_client.infer("emulated", [tensor], headers={"cache-control": "no-store"})
        assert by_grpc.as_numpy("OUTPUT0").tolist() == [float(WORDS)] * 32

        # 20 batches (5.3 s) ahead: a request of two more cannot finish within its two SLOs, and
        # is refused at once on each route, not queued to expire
        busy = threading.Thread(target=lambda: http.post("/v2/models/emulated/infer", json=_rows_body(320, WORDS)))
        busy.start()
        time.sleep(0.5)
        started = time.monotonic()
        refused = http.post("/v2/models/emulated/infer", json=_rows_body(32, WORDS, 2.0))
        assert refused.status_code == 503, refused.text
        assert "deadline" in refused.json()["error"] and int(refused.headers["retry-after"]) >= 1
        with pytest.raises(openai.InternalServerError) as shed:
            sdk.embeddings.create(model="emulated", input=[f"busy {text}" for text in texts])
        assert shed.value.status_code == 503
        with pytest.raises(InferenceServerException) as shed_grpc:
            grpc_client.infer("emulated", [tensor], headers={"cache-control": "no-store"})
        assert shed_grpc.value.status() == "StatusCode.UNAVAILABLE"
        assert time.monotonic() - started < 2.0
        busy.join()
    grpc_client.close()


def _rows_body(num_rows: int, length: int, value: float = 1.0) -> dict[str, object]:
    return {"inputs": [{"name": "INPUT0", "shape": [num_rows, length], "datatype": "FP32",
                        "data": [value] * num_rows * length}]}


def test_a_deadline_that_passes_while_the_body_arrives_is_answered_504_before_admission(make_server, emulated_repo):
    """The deadline counts from the request's arrival (its head): a body that takes longer than it
    to come is answered 504 at once, counted as expired at the client's deadline, and never
    admitted or sent to a worker."""
    server = make_server(emulated_repo())
    body = json.dumps(BODY).encode()
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v2/models/emulated/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"X-Request-Timeout-Ms: 200\r\nContent-Length: %d\r\n\r\n" % len(body))
        sock.sendall(body[:10])
        time.sleep(0.5)
        sock.sendall(body[10:])
        head = sock.recv(65536).split(b"\r\n\r\n", 1)[0].decode()
    assert head.startswith("HTTP/1.1 504 "), head
    assert metric_total(server, "sluice_expired_requests_total", deadline="client") == 1
    assert metric_total(server, "sluice_tenant_rejected_total", reason="expired") == 1
    assert metric_total(server, "sluice_tenant_admitted_total") == 0
    assert metric_total(server, "sluice_batch_size_count") == 0, "it reached the device"

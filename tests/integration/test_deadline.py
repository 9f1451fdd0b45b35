"""A client deadline the model cannot meet is answered 504 at once, and does not harm the server."""

from __future__ import annotations

import time

import httpx

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

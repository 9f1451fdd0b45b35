"""The access log of a real `sluice serve`: one JSON line on stderr per finished request, with the
fields an operator filters on, and never the prompt, the query string or the API key."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as triton

from sluice.gateway.tenants import hash_key, new_key
from tests.conftest import ServerProcess, free_port, start_server, write_emulated_model, write_tiny_lm_model

SECRET = "do-not-log-this-prompt"
KEY = new_key()
INPUTS = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, int]]:
    repo = tmp_path_factory.mktemp("repo")
    write_emulated_model(repo, "emulated")
    write_tiny_lm_model(repo, "tiny")
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    tenants.write_text(f'[tenants.acme]\napi_keys = ["{hash_key(KEY)}"]\n')
    grpc_port = free_port()
    started = start_server(repo, tmp_path_factory.mktemp("log"), "--tenants", str(tenants),
                           "--grpc-port", str(grpc_port))
    yield started, grpc_port
    started.stop()


def access_lines(server: ServerProcess) -> list[dict[str, Any]]:
    lines = []
    for line in server.log().splitlines():
        if '"sluice.access"' in line:
            lines.append(json.loads(line))
    return lines


def line_for(server: ServerProcess, request_id: str) -> dict[str, Any]:
    """The access line of the request with this id, once written (it follows the answer)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        found = [line for line in access_lines(server) if line["request_id"] == request_id]
        if found:
            assert len(found) == 1, found
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no access line for {request_id}: {access_lines(server)}")


def headers(request_id: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}", "x-request-id": request_id}


def test_an_answered_request_is_one_line_with_its_fields(server: tuple[ServerProcess, int]) -> None:
    sluice, _ = server
    answer = httpx.post(f"{sluice.url}/v2/models/emulated/infer?token={SECRET}", json=INPUTS,
                        headers=headers("ok-1"))
    assert answer.status_code == 200
    line = line_for(sluice, "ok-1")
    assert line["logger"] == "sluice.access" and line["level"] == "INFO" and line["process"] == "gateway"
    assert {k: line[k] for k in ("method", "path", "status", "tenant", "model", "model_version", "protocol",
                                 "outcome")} == {
        "method": "POST", "path": "/v2/models/emulated/infer", "status": 200, "tenant": "acme",
        "model": "emulated", "model_version": "1", "protocol": "kserve", "outcome": "ok"}
    assert isinstance(line["duration_ms"], float) and line["duration_ms"] > 0
    assert SECRET not in sluice.log() and KEY not in sluice.log()


def test_a_refused_request_is_logged_with_its_status_and_never_its_input(server: tuple[ServerProcess, int]) -> None:
    sluice, _ = server
    refused = httpx.post(f"{sluice.url}/v1/embeddings", json={"model": "emulated", "input": [SECRET, 7]},
                         headers=headers("bad-1"))
    assert refused.status_code == 400
    unknown = httpx.post(f"{sluice.url}/v1/embeddings", json={"model": "emulated", "input": SECRET},
                         headers={"Authorization": "Bearer sk-not-a-key", "x-request-id": "bad-2"})
    assert unknown.status_code == 401
    line = line_for(sluice, "bad-1")
    assert (line["status"], line["outcome"], line["protocol"]) == (400, "invalid", "openai")
    assert (line["tenant"], line["model"], line["path"]) == ("acme", "emulated", "/v1/embeddings")
    line = line_for(sluice, "bad-2")
    assert (line["status"], line["outcome"], line["tenant"]) == (401, "unauthenticated", None)
    assert SECRET not in sluice.log() and "sk-not-a-key" not in sluice.log() and KEY not in sluice.log()


def test_a_stream_is_logged_when_it_ends_and_one_cut_short_as_cancelled(server: tuple[ServerProcess, int]) -> None:
    sluice, _ = server
    with openai.OpenAI(base_url=f"{sluice.url}/v1", api_key=KEY, max_retries=0) as sdk:
        stream = sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": SECRET}], max_tokens=4, stream=True,
            extra_headers={"x-request-id": "stream-1"})
        assert [chunk for chunk in stream]
        cut = sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": SECRET}], max_tokens=1000, stream=True,
            extra_body={"ignore_eos": True}, extra_headers={"x-request-id": "stream-2"})
        next(iter(cut))
        cut.close()  # the client goes away mid-stream
    line = line_for(sluice, "stream-1")
    assert (line["path"], line["status"], line["outcome"]) == ("/v1/chat/completions", 200, "ok")
    assert (line["tenant"], line["model"], line["model_version"]) == ("acme", "tiny", "1")
    line = line_for(sluice, "stream-2")
    assert (line["status"], line["outcome"]) == (200, "cancelled")
    assert SECRET not in sluice.log()


def test_a_stream_ended_by_an_error_event_keeps_its_200_and_logs_the_errors_outcome(
        server: tuple[ServerProcess, int]) -> None:
    """A format the engine finds it cannot follow only mid-stream (llguidance builds the regex's
    lexer lazily): the 200 head is out, the stream ends with an error event naming the field."""
    sluice, _ = server
    with openai.OpenAI(base_url=f"{sluice.url}/v1", api_key=KEY, max_retries=0, timeout=60) as sdk:
        stream = sdk.completions.create(model="tiny", prompt=SECRET, max_tokens=40, seed=1, stream=True,
                                        extra_body={"guided_regex": "(ab )+a{1000000}"},
                                        extra_headers={"x-request-id": "stream-failed"})
        with pytest.raises(openai.APIError) as caught:
            for _ in stream:
                pass
    assert caught.value.body["param"] == "guided_regex"  # type: ignore[index]
    line = line_for(sluice, "stream-failed")
    assert (line["path"], line["status"], line["outcome"]) == ("/v1/completions", 200, "invalid")
    assert SECRET not in sluice.log()


def test_a_responses_stream_cut_short_by_its_workers_death_is_logged_unavailable(
        make_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    sluice = make_server(write_tiny_lm_model(tmp_path / "repo"))
    with httpx.stream("POST", f"{sluice.url}/v1/responses", timeout=120, headers={"x-request-id": "cut-1"},
                      json={"model": "tiny", "input": SECRET, "max_output_tokens": 300, "stream": True}) as answer:
        assert answer.status_code == 200
        events = answer.iter_lines()
        for event in events:
            if '"response.output_text.delta"' in event:  # generating: its worker dies
                os.kill(sluice.worker_pids()[0], signal.SIGKILL)
                break
        rest = [json.loads(event.removeprefix("data: ")) for event in events if event.startswith("data: ")]
    assert rest[-1]["type"] == "error" and rest[-1]["code"] == "worker_lost", rest[-1]
    line = line_for(sluice, "cut-1")
    assert (line["path"], line["status"], line["outcome"]) == ("/v1/responses", 200, "unavailable")


def test_grpc_inference_is_logged_too(server: tuple[ServerProcess, int]) -> None:
    sluice, grpc_port = server
    tensor = triton.InferInput("INPUT0", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    with triton.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
        client.infer("emulated", [tensor], headers={"authorization": f"Bearer {KEY}", "x-request-id": "grpc-1"})
        with pytest.raises(triton.InferenceServerException):
            client.infer("absent", [tensor], headers={"authorization": f"Bearer {KEY}", "x-request-id": "grpc-2"})
    line = line_for(sluice, "grpc-1")
    assert {k: line[k] for k in ("method", "status", "grpc_status", "tenant", "model", "model_version",
                                 "protocol", "outcome")} == {
        "method": "ModelInfer", "status": 200, "grpc_status": "OK", "tenant": "acme", "model": "emulated",
        "model_version": "1", "protocol": "grpc", "outcome": "ok"}
    line = line_for(sluice, "grpc-2")
    assert (line["status"], line["grpc_status"], line["outcome"], line["model"]) == (
        404, "NOT_FOUND", "not_found", "absent")


def test_grpc_health_metadata_and_repository_calls_are_logged_as_over_http(server: tuple[ServerProcess, int]) -> None:
    sluice, grpc_port = server

    def as_acme(request_id: str) -> dict[str, str]:
        return {"authorization": f"Bearer {KEY}", "x-request-id": request_id}

    with triton.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
        assert client.is_server_live(headers={"x-request-id": "live"})
        assert client.is_server_ready(headers={"x-request-id": "ready"})
        assert client.get_server_metadata(headers=as_acme("server-metadata")).name == "sluice"
        assert client.is_model_ready("emulated", headers=as_acme("model-ready"))
        assert client.get_model_metadata("emulated", "1", headers=as_acme("model-metadata")).name == "emulated"
        assert client.get_model_config("emulated", headers=as_acme("model-config")).config.name == "emulated"
        assert client.get_inference_statistics("emulated", headers=as_acme("statistics"))
        assert client.get_model_repository_index(headers=as_acme("index")).models
        with pytest.raises(triton.InferenceServerException):
            client.get_model_metadata("absent", headers=as_acme("metadata-absent"))
        with pytest.raises(triton.InferenceServerException):
            client.get_server_metadata(headers={"authorization": "Bearer sk-not-a-key", "x-request-id": "no-key"})
        with pytest.raises(triton.InferenceServerException):
            client.load_model("emulated", headers=as_acme("load-not-admin"))
        with pytest.raises(triton.InferenceServerException):
            client.get_system_shared_memory_status(headers=as_acme("shared-memory"))
    expected = {
        "live": ("ServerLive", 200, "OK", "ok", None, None, None),
        "ready": ("ServerReady", 200, "OK", "ok", None, None, None),
        "server-metadata": ("ServerMetadata", 200, "OK", "ok", "acme", None, None),
        "model-ready": ("ModelReady", 200, "OK", "ok", "acme", "emulated", None),
        "model-metadata": ("ModelMetadata", 200, "OK", "ok", "acme", "emulated", "1"),
        "model-config": ("ModelConfig", 200, "OK", "ok", "acme", "emulated", None),
        "statistics": ("ModelStatistics", 200, "OK", "ok", "acme", "emulated", None),
        "index": ("RepositoryIndex", 200, "OK", "ok", "acme", None, None),
        "metadata-absent": ("ModelMetadata", 404, "NOT_FOUND", "not_found", "acme", "absent", None),
        "no-key": ("ServerMetadata", 401, "UNAUTHENTICATED", "unauthenticated", None, None, None),
        "load-not-admin": ("RepositoryModelLoad", 403, "PERMISSION_DENIED", "denied", None, "emulated", None),
        "shared-memory": ("SystemSharedMemoryStatus", 501, "UNIMPLEMENTED", "error", None, None, None),
    }
    for request_id, fields in expected.items():
        line = line_for(sluice, request_id)
        assert (line["protocol"], line["path"]) == ("grpc", f"/inference.GRPCInferenceService/{fields[0]}")
        assert isinstance(line["duration_ms"], float)
        assert tuple(line[k] for k in ("method", "status", "grpc_status", "outcome", "tenant", "model",
                                       "model_version")) == fields, request_id
    assert KEY not in sluice.log() and "sk-not-a-key" not in sluice.log()


def test_a_refusal_the_http_layer_writes_itself_is_logged(server: tuple[ServerProcess, int]) -> None:
    """A request the HTTP protocol refuses before any route sees it (a transfer coding it cannot
    read, bytes that are not HTTP) leaves its line too, with what of it was read."""
    sluice, _ = server
    host, port = sluice.url.removeprefix("http://").split(":")

    def answer_to(data: bytes) -> bytes:
        with socket.create_connection((host, int(port)), timeout=20) as conn:
            conn.sendall(data)
            received = b""
            while chunk := conn.recv(65536):
                received += chunk
            return received

    gzipped = answer_to(b"POST /v1/embeddings?token=" + SECRET.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                        b"Transfer-Encoding: gzip, chunked\r\n\r\n")
    assert gzipped.startswith(b"HTTP/1.1 501")
    garbage = answer_to(b"\x16\x03\x01 not http at all\r\n\r\n")
    assert garbage.startswith(b"HTTP/1.1 400")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        refusals = [line for line in access_lines(sluice) if line["request_id"] is None]
        if len(refusals) >= 2:
            break
        time.sleep(0.05)
    assert [(line["method"], line["path"], line["status"], line["outcome"], line["protocol"]) for line in refusals] == [
        ("POST", "/v1/embeddings", 501, "invalid", "openai"), (None, None, 400, "invalid", "http")]
    assert SECRET not in sluice.log()


def test_no_access_log_turns_it_off(tmp_path: Path) -> None:
    sluice = start_server(write_emulated_model(tmp_path / "models"), tmp_path, "--no-access-log")
    try:
        answer = httpx.post(f"{sluice.url}/v2/models/emulated/infer", json=INPUTS, headers={"x-request-id": "off"})
        assert answer.status_code == 200
    finally:
        sluice.stop()
    assert '"sluice.access"' not in sluice.log()

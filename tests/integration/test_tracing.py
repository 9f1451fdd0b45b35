"""OpenTelemetry traces from a real `sluice serve`, received by a small OTLP/HTTP collector that
the test runs: the request's span joins the caller's trace, its queue wait and execution are
child spans, failures are marked as errors, and no input text is ever exported."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from sluice.clock import MonotonicClock
from sluice.gateway.tenants import hash_key, new_key
from sluice.tracing import from_environment
from tests.conftest import (
    ServerProcess,
    free_port,
    metric_total,
    start_server,
    write_emulated_model,
    write_tiny_lm_model,
)
from tests.upstream_server import UpstreamServer

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
SECRET = "do-not-export-this-text"


class _Collector(http.server.ThreadingHTTPServer):
    def __init__(self, port: int) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.bodies: list[bytes] = []
        self.spans: list[Span] = []


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Collector

    def do_POST(self) -> None:  # the http.server API's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        export = ExportTraceServiceRequest.FromString(body)
        self.server.bodies.append(body)
        for resource_spans in export.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                self.server.spans.extend(scope_spans.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def collector(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Collector]:
    """An OTLP/HTTP collector, and the environment that has a server the test starts export its
    spans to it."""
    server = _Collector(free_port())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{server.server_port}/v1/traces")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export every 0.1 s
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def traced_server(tmp_path: Path, collector: _Collector) -> Iterator[ServerProcess]:
    server = start_server(write_emulated_model(tmp_path / "models"), tmp_path)
    yield server
    server.stop()


def _wait_for(collector: _Collector, count: int) -> list[Span]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        requests = [s for s in collector.spans if s.name == "sluice.request"]
        if len(requests) >= count:
            return list(collector.spans)
        time.sleep(0.05)
    raise AssertionError(f"expected {count} request spans, got {[s.name for s in collector.spans]}")


def _attributes(span: Span) -> dict[str, object]:
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}


def _proxy_models(repo: Path, upstream: UpstreamServer) -> Path:
    """`proxy`, an openai-upstream model, and `single`, an http-single one, both served by `upstream`."""
    (repo / "proxy" / "1").mkdir(parents=True)
    (repo / "proxy" / "model.toml").write_text(
        f'kind = "openai-upstream"\n[slo]\ndefault_ms = 60000\n[upstream]\nurl = "http://127.0.0.1:{upstream.port}/v1"\n')
    (repo / "single" / "1").mkdir(parents=True)
    (repo / "single" / "model.toml").write_text(
        f'kind = "http-single"\n[slo]\ndefault_ms = 60000\n[params]\nurl = "{upstream.url}"\nmax_attempts = 1\n')
    return repo


def test_a_request_span_joins_the_callers_trace_with_queue_and_execution_inside(
        traced_server: ServerProcess, collector: _Collector) -> None:
    inputs = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    answer = httpx.post(f"{traced_server.url}/v2/models/emulated/infer", json=inputs,
                        headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert answer.status_code == 200
    embedded = httpx.post(f"{traced_server.url}/v1/embeddings", json={"model": "emulated", "input": SECRET})
    assert embedded.status_code == 200
    other = {"inputs": [{**inputs["inputs"][0], "data": [5, 6, 7, 8]}]}  # not the cached answer above
    late = httpx.post(f"{traced_server.url}/v2/models/emulated/infer", json=other,
                      headers={"x-request-timeout-ms": "1"})
    assert late.status_code == 504

    spans = _wait_for(collector, 3)
    (traced,) = [s for s in spans if s.name == "sluice.request" and s.trace_id.hex() == TRACE_ID]
    assert traced.parent_span_id.hex() == PARENT_ID
    assert traced.kind == Span.SPAN_KIND_SERVER
    attributes = _attributes(traced)
    assert attributes["sluice.model"] == "emulated" and attributes["sluice.outcome"] == "ok"
    assert attributes["sluice.batch_size"] == 1
    children = {s.name: s for s in spans if s.parent_span_id == traced.span_id}
    assert set(children) == {"sluice.queue", "sluice.execute"}
    queue, execute = children["sluice.queue"], children["sluice.execute"]
    assert traced.start_time_unix_nano <= queue.start_time_unix_nano <= queue.end_time_unix_nano
    assert queue.end_time_unix_nano == execute.start_time_unix_nano
    assert execute.end_time_unix_nano <= traced.end_time_unix_nano
    execute_ms = (execute.end_time_unix_nano - execute.start_time_unix_nano) / 1e6
    assert execute_ms > 5  # the emulator's one-row batch (8 ms + 0.5 ms), not an empty span

    (expired,) = [s for s in spans if s.name == "sluice.request" and _attributes(s)["sluice.outcome"] == "expired"]
    assert expired.status.code == Status.STATUS_CODE_ERROR
    assert expired.trace_id.hex() != TRACE_ID  # no traceparent: a trace of its own
    assert not any(SECRET.encode() in body for body in collector.bodies)


def test_tracing_is_off_without_an_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert not from_environment(MonotonicClock()).is_enabled
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not from_environment(MonotonicClock()).is_enabled


def test_a_request_refused_for_its_input_is_a_span_in_the_callers_trace(
        traced_server: ServerProcess, collector: _Collector) -> None:
    """Counted as `invalid` in /metrics, so traced too: a 400 whose span is missing leaves the
    caller's trace with a hole where sluice answered."""
    wrong_shape = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2]}]}
    answer = httpx.post(f"{traced_server.url}/v2/models/emulated/infer", json=wrong_shape,
                        headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert answer.status_code == 400
    embedded = httpx.post(f"{traced_server.url}/v1/embeddings", json={"model": "emulated", "input": [SECRET, 7]},
                          headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert embedded.status_code == 400

    spans = [s for s in _wait_for(collector, 2) if s.name == "sluice.request"]
    assert len(spans) == 2
    for span in spans:
        assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
        attributes = _attributes(span)
        assert attributes["sluice.model"] == "emulated" and attributes["sluice.outcome"] == "invalid"
        assert span.status.code == Status.STATUS_CODE_UNSET  # the client's error, not the server's
    assert not any(SECRET.encode() in body for body in collector.bodies)


def test_a_request_refused_by_its_tenants_limit_is_a_span_too(
        tmp_path: Path, collector: _Collector) -> None:
    """A 429 for a tenant's limit was counted in sluice_tenant_rejected_total but left no span."""
    key = new_key()
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.acme]\napi_keys = ["{hash_key(key)}"]\nrequests_per_min = 1\n')
    server = start_server(write_emulated_model(tmp_path / "models"), tmp_path, "--tenants", str(tenants))
    try:
        inputs = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
        headers = {"Authorization": f"Bearer {key}", "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
        assert httpx.post(f"{server.url}/v2/models/emulated/infer", json=inputs, headers=headers).status_code == 200
        refused = httpx.post(f"{server.url}/v2/models/emulated/infer", json=inputs, headers=headers)
        assert refused.status_code == 429
        spans = [s for s in _wait_for(collector, 2) if s.name == "sluice.request"]
    finally:
        server.stop()
    (limited,) = [s for s in spans if _attributes(s)["sluice.outcome"] == "rate_limited"]
    assert limited.trace_id.hex() == TRACE_ID and limited.parent_span_id.hex() == PARENT_ID
    attributes = _attributes(limited)
    assert attributes["sluice.tenant"] == "acme" and attributes["sluice.limit"] == "requests"
    assert limited.status.code == Status.STATUS_CODE_UNSET  # a 4xx: the client's limit, not a server error


def test_a_client_that_goes_away_leaves_a_cancelled_span_not_an_error(
        tmp_path: Path, collector: _Collector) -> None:
    """A client closing its connection is not a server error: the span says `cancelled` (an
    attribute and an event) and keeps an unset status, where it was marked ERROR."""
    repo = write_emulated_model(tmp_path / "models", "slow", alpha_ms=3000, beta_ms=0.0, max_batch_size=1,
                                slo_ms=30000)
    server = start_server(repo, tmp_path)
    try:
        inputs = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            httpx.post(f"{server.url}/v2/models/slow/infer", json=inputs, timeout=0.5,
                       headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
        (span,) = [s for s in _wait_for(collector, 1) if s.name == "sluice.request"]
    finally:
        server.stop()
    assert _attributes(span)["sluice.outcome"] == "cancelled"
    assert span.status.code == Status.STATUS_CODE_UNSET
    assert [event.name for event in span.events] == ["sluice.cancelled"]


def test_a_generation_span_reports_the_sequences_it_ran_with(
        tmp_path: Path, collector: _Collector) -> None:
    """The generative engine's answers said batch_size 0: a lone generation ran in batches of
    one sequence, and one of n=2 choices ran with its two sequences together."""
    server = start_server(write_tiny_lm_model(tmp_path / "models", "tiny"), tmp_path)
    try:
        for n in (1, 2):
            answer = httpx.post(f"{server.url}/v1/completions", timeout=60,
                                json={"model": "tiny", "prompt": SECRET, "max_tokens": 8, "n": n, "ignore_eos": True},
                                headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
            assert answer.status_code == 200, answer.text
            assert len(answer.json()["choices"]) == n
        spans = [s for s in _wait_for(collector, 2) if s.name == "sluice.request"]
    finally:
        server.stop()
    assert sorted(_attributes(s)["sluice.batch_size"] for s in spans) == [1, 2]
    assert not any(SECRET.encode() in body for body in collector.bodies)


def test_a_call_to_an_openai_upstream_carries_the_trace_on(
        tmp_path: Path, collector: _Collector) -> None:
    """The upstream (vLLM, another sluice) got no `traceparent`: its spans started traces of their
    own, cut off from the caller's. Now its call names the gateway's request span as its parent."""
    with UpstreamServer() as upstream:
        server = start_server(_proxy_models(tmp_path / "models", upstream), tmp_path)
        try:
            sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60,
                                default_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
            streamed = sdk.chat.completions.create(model="proxy", messages=[{"role": "user", "content": SECRET}],
                                                   max_tokens=4, stream=True)
            assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
            sent = upstream.last_headers.get("traceparent") or upstream.last_headers.get("Traceparent")
            (span,) = [s for s in _wait_for(collector, 1) if s.name == "sluice.request"]
        finally:
            server.stop()
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    assert sent == f"00-{TRACE_ID}-{span.span_id.hex()}-01"
    assert not any(SECRET.encode() in body for body in collector.bodies)


def _gen_ai(span: Span) -> dict[str, object]:
    found: dict[str, object] = {}
    for a in span.attributes:
        if a.key.startswith("gen_ai."):
            kind = a.value.WhichOneof("value")
            found[a.key] = [v.string_value for v in a.value.array_value.values] if kind == "array_value" \
                else getattr(a.value, kind)
    return found


def test_spans_carry_opentelemetrys_genai_attributes(
        tmp_path: Path, collector: _Collector) -> None:
    """Spans had only `sluice.*` attributes: a tracing backend's GenAI views (model, operation,
    token usage, finish reasons) showed nothing for sluice's requests."""
    repo = write_tiny_lm_model(write_emulated_model(tmp_path / "models"), "tiny")
    server = start_server(repo, tmp_path)
    try:
        sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        chat = sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": SECRET}], max_tokens=5,
                                           temperature=0.5, top_p=0.9, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(chat)
        (usage,) = [chunk.usage for chunk in chunks if chunk.usage is not None]
        finished = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
        completion = sdk.completions.create(model="tiny", prompt=SECRET, max_tokens=3, n=2, seed=7)
        embedded = sdk.embeddings.create(model="emulated", input=[SECRET, "two"])
        spans = {_gen_ai(s)["gen_ai.operation.name"]: _gen_ai(s)
                 for s in _wait_for(collector, 3) if s.name == "sluice.request"}
    finally:
        server.stop()
    assert spans["chat"] == {
        "gen_ai.operation.name": "chat", "gen_ai.request.model": "tiny", "gen_ai.request.max_tokens": 5,
        "gen_ai.request.temperature": 0.5, "gen_ai.request.top_p": 0.9,
        "gen_ai.usage.input_tokens": usage.prompt_tokens, "gen_ai.usage.output_tokens": usage.completion_tokens,
        "gen_ai.response.finish_reasons": finished}
    assert spans["text_completion"]["gen_ai.request.choice.count"] == 2
    assert spans["text_completion"]["gen_ai.request.seed"] == 7
    assert spans["text_completion"]["gen_ai.usage.output_tokens"] == completion.usage.completion_tokens
    assert spans["text_completion"]["gen_ai.response.finish_reasons"] == [c.finish_reason for c in completion.choices]
    assert spans["embeddings"] == {"gen_ai.operation.name": "embeddings", "gen_ai.request.model": "emulated",
                                   "gen_ai.usage.input_tokens": embedded.usage.prompt_tokens}
    assert not any(SECRET.encode() in body for body in collector.bodies)


def test_an_answer_from_the_result_cache_has_no_queue_or_execution_spans(
        traced_server: ServerProcess, collector: _Collector) -> None:
    """A cached answer's span had `sluice.queue` and `sluice.execute` children (of zero length,
    batch size 0) as if it had run; and without a tenants file `sluice.tenant` was "" where the
    metrics and the access log say `local`."""
    inputs = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [9, 8, 7, 6]}]}
    for _ in range(2):
        answer = httpx.post(f"{traced_server.url}/v2/models/emulated/infer", json=inputs)
        assert answer.status_code == 200
    assert answer.headers["x-sluice-cache"] == "hit"
    spans = _wait_for(collector, 2)
    ran, cached = sorted((s for s in spans if s.name == "sluice.request"), key=lambda s: s.start_time_unix_nano)
    children = {s.name for s in spans if s.parent_span_id == ran.span_id}
    assert children == {"sluice.queue", "sluice.execute"}
    assert not [s for s in spans if s.parent_span_id == cached.span_id]
    assert _attributes(cached)["sluice.cache"] == "hit" and "sluice.batch_size" not in _attributes(cached)
    assert _attributes(ran)["sluice.tenant"] == _attributes(cached)["sluice.tenant"] == "local"


def test_without_tracing_an_upstream_call_passes_the_callers_trace_on_unchanged(tmp_path: Path) -> None:
    """A server that does not trace still passes the caller's `traceparent` on (W3C Trace
    Context), so the caller's and the upstream's spans stay one trace; one that is not well
    formed is not sent on."""
    with UpstreamServer() as upstream:
        server = start_server(_proxy_models(tmp_path / "models", upstream), tmp_path)
        try:
            sent = []
            for traceparent in (f"00-{TRACE_ID}-{PARENT_ID}-01", "00-not-a-trace-01"):
                with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60,
                                   default_headers={"traceparent": traceparent}) as sdk:
                    assert sdk.completions.create(model="proxy", prompt=SECRET, max_tokens=4).choices
                sent.append({k.lower(): v for k, v in upstream.last_headers.items()}.get("traceparent"))
        finally:
            server.stop()
    assert sent == [f"00-{TRACE_ID}-{PARENT_ID}-01", None]


TRACESTATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"


def _sent(upstream: UpstreamServer) -> dict[str, str]:
    """The trace headers of the upstream's last request (lower-cased names)."""
    headers = {name.lower(): value for name, value in upstream.last_headers.items()}
    return {name: headers[name] for name in ("traceparent", "tracestate") if name in headers}


def _text_input(prompt: str) -> dict[str, object]:
    return {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [prompt]}],
            "parameters": {"max_tokens": 4}}


def test_tracestate_goes_on_to_an_upstream_with_the_callers_trace(
        tmp_path: Path, collector: _Collector) -> None:
    """The caller's `tracestate` (W3C Trace Context: vendors' entries that travel with the trace)
    was dropped: the request's span and the upstream's call had none."""
    with UpstreamServer() as upstream:
        server = start_server(_proxy_models(tmp_path / "models", upstream), tmp_path)
        try:
            with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60,
                               default_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01",
                                                "tracestate": TRACESTATE}) as sdk:
                assert sdk.chat.completions.create(model="proxy", messages=[{"role": "user", "content": SECRET}],
                                                   max_tokens=4).choices
            sent = _sent(upstream)
            (span,) = [s for s in _wait_for(collector, 1) if s.name == "sluice.request"]
        finally:
            server.stop()
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    assert span.trace_state == TRACESTATE
    assert sent == {"traceparent": f"00-{TRACE_ID}-{span.span_id.hex()}-01", "tracestate": TRACESTATE}


def test_without_tracing_tracestate_goes_on_unchanged(tmp_path: Path) -> None:
    """A server that does not trace passes the caller's `traceparent` and `tracestate` on
    together; a `tracestate` without a well-formed `traceparent` is not sent on."""
    with UpstreamServer() as upstream:
        server = start_server(_proxy_models(tmp_path / "models", upstream), tmp_path)
        try:
            sent = []
            for traceparent in (f"00-{TRACE_ID}-{PARENT_ID}-01", "00-not-a-trace-01"):
                with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60,
                                   default_headers={"traceparent": traceparent, "tracestate": TRACESTATE}) as sdk:
                    assert sdk.completions.create(model="proxy", prompt=SECRET, max_tokens=4).choices
                sent.append(_sent(upstream))
        finally:
            server.stop()
    assert sent == [{"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "tracestate": TRACESTATE}, {}]


def test_a_kserve_generation_joins_the_callers_trace_as_v1_completions_do(
        tmp_path: Path, collector: _Collector) -> None:
    """KServe infer on a generative model (text_input in, text_output out) is a generation as
    /v1/completions is: its span joins the caller's trace, and its upstream call names that span."""
    with UpstreamServer() as upstream:
        server = start_server(_proxy_models(tmp_path / "models", upstream), tmp_path)
        try:
            answer = httpx.post(f"{server.url}/v2/models/proxy/infer", json=_text_input(SECRET), timeout=60,
                                headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
            assert answer.status_code == 200, answer.text
            sent = _sent(upstream)
            (span,) = [s for s in _wait_for(collector, 1) if s.name == "sluice.request"]
        finally:
            server.stop()
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    assert sent == {"traceparent": f"00-{TRACE_ID}-{span.span_id.hex()}-01"}
    assert not any(SECRET.encode() in body for body in collector.bodies)


def test_without_tracing_a_kserve_generation_passes_the_callers_trace_on(tmp_path: Path) -> None:
    """/v1/completions passed an untraced server's caller's trace context on to an openai-upstream
    model; KServe infer on the same model (text_input), over HTTP or gRPC, dropped it. And a KServe
    generation was missing from sluice_requests_total: its accounting was lost."""
    import numpy as np
    import tritonclient.grpc as triton_grpc

    grpc_port = free_port()
    given = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "tracestate": TRACESTATE}
    with UpstreamServer() as upstream:
        server = start_server(_proxy_models(tmp_path / "models", upstream), tmp_path, "--grpc-port", str(grpc_port))
        try:
            sent = []
            for traceparent in (given["traceparent"], "00-not-a-trace-01"):
                answer = httpx.post(f"{server.url}/v2/models/proxy/infer", json=_text_input(SECRET), timeout=60,
                                    headers={"traceparent": traceparent, "tracestate": TRACESTATE})
                assert answer.status_code == 200, answer.text
                sent.append(_sent(upstream))
            text = triton_grpc.InferInput("text_input", [1], "BYTES")
            text.set_data_from_numpy(np.array([SECRET.encode()], dtype=np.object_))
            with triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
                generated = client.infer("proxy", [text], parameters={"max_tokens": 4}, headers=given)
            assert list(generated.as_numpy("text_output")) == [SECRET.encode() + b"Hello world"]
            sent.append(_sent(upstream))
            counted = metric_total(server, "sluice_requests_total", model="proxy", outcome="ok")
        finally:
            server.stop()
    assert sent == [given, {}, given]
    assert counted == 3


def test_a_call_to_an_http_single_upstream_carries_the_trace_on(
        tmp_path: Path, collector: _Collector) -> None:
    """An http-single model's calls (a user's HTTP model server) carried no `traceparent`: its
    spans were cut off from the caller's trace. Now a call names the request's span."""
    inputs = {"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
    with UpstreamServer() as upstream:
        server = start_server(_proxy_models(tmp_path / "models", upstream), tmp_path)
        try:
            answer = httpx.post(f"{server.url}/v2/models/single/infer", json=inputs, timeout=60,
                                headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "tracestate": TRACESTATE})
            assert answer.status_code == 200, answer.text
            assert answer.json()["outputs"][0]["data"] == [6.0]
            sent = _sent(upstream)
            (span,) = [s for s in _wait_for(collector, 1) if s.name == "sluice.request"]
        finally:
            server.stop()
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    assert sent == {"traceparent": f"00-{TRACE_ID}-{span.span_id.hex()}-01", "tracestate": TRACESTATE}


def test_without_tracing_an_http_single_call_passes_the_callers_trace_on_unchanged(tmp_path: Path) -> None:
    """The same rules as openai-upstream's: a well-formed `traceparent` (and its `tracestate`)
    goes on unchanged; one that is not well formed does not go on."""
    with UpstreamServer() as upstream:
        server = start_server(_proxy_models(tmp_path / "models", upstream), tmp_path)
        try:
            sent = []
            for n, traceparent in enumerate((f"00-{TRACE_ID}-{PARENT_ID}-01", "00-not-a-trace-01")):
                inputs = {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [n, 1]}]}
                answer = httpx.post(f"{server.url}/v2/models/single/infer", json=inputs, timeout=60,
                                    headers={"traceparent": traceparent, "tracestate": TRACESTATE})
                assert answer.status_code == 200, answer.text
                sent.append(_sent(upstream))
        finally:
            server.stop()
    assert sent == [{"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "tracestate": TRACESTATE}, {}]


def test_without_tracing_a_grpc_call_passes_on_every_tracestate_entry_it_carried(tmp_path: Path) -> None:
    """W3C Trace Context lets a `tracestate` be split over several header lines (gRPC metadata
    entries), which together are one list; the HTTP path joins them. The gRPC path kept the first
    entry only, so the upstream got `congo=...` without `rojo=...`."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    grpc_port = free_port()
    first, second = TRACESTATE.split(",")
    request = service_pb2.ModelInferRequest(model_name="proxy")
    text = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    text.contents.bytes_contents.append(SECRET.encode())
    request.parameters["max_tokens"].int64_param = 4
    metadata = (("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"), ("tracestate", first), ("tracestate", second))
    with UpstreamServer() as upstream:
        server = start_server(_proxy_models(tmp_path / "models", upstream), tmp_path, "--grpc-port", str(grpc_port))
        try:
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
                answer = stub.ModelInfer(request, metadata=metadata, timeout=60)
            assert [output.name for output in answer.outputs] == ["text_output"]
            sent = _sent(upstream)
        finally:
            server.stop()
    assert sent == {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "tracestate": TRACESTATE}

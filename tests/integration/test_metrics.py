"""`/metrics` as Prometheus' own tooling sees it, after traffic of every kind: `promtool check
metrics` on the gateway's and on a worker's own scrape, and the README's list of metric names
against what a live server exports.

    client ──openai SDK / tritonclient http+grpc / httpx──▶ sluice serve ──▶ worker ──▶ upstream (openai-upstream)
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import prometheus_client
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from prometheus_client.parser import text_string_to_metric_families

from sluice import metrics
from sluice.gateway.tenants import hash_key
from tests.conftest import (
    ServerProcess,
    eventually,
    free_port,
    start_server,
    stop_all,
    write_emulated_model,
    write_tiny_lm_model,
)
from tests.upstream_server import UpstreamServer
from tests.user_models import add_gated_version

pytestmark = pytest.mark.slow

README = Path(__file__).parents[2] / "README.md"
KEY, LIMITED_KEY = "sk-metrics-test-acme", "sk-metrics-test-limited"
VLLM_NAMES = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
"""promtool's one lint that stays: these names have a colon because the Gateway API Inference
Extension and other LLM routers read vLLM's names (vLLM's own /metrics draws the same lint)."""


def _promtool_lints(text: str) -> list[str]:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is not installed (Debian's prometheus package); ./scripts/test installs it")
    checked = subprocess.run([binary, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    lints = [line for line in (checked.stdout + checked.stderr).splitlines() if line.strip()]
    assert checked.returncode == 0 or lints, "promtool failed without saying why"
    allowed = {f"{name} metric names should not contain ':'" for name in VLLM_NAMES}
    return [lint for lint in lints if lint not in allowed]


def _families(text: str) -> dict[str, str]:
    """Each family's exported name (a counter's with `_total`, as the docs and PromQL name it) -> type."""
    return {f"{f.name}_total" if f.type == "counter" else f.name: f.type
            for f in text_string_to_metric_families(text)}


def _serve_traffic(server: ServerProcess, grpc_port: int) -> None:
    """Embeddings, completions and chats (one streamed) on a local model and through an upstream,
    KServe infer over HTTP and gRPC, input refused, a tenant's limit, a batch job."""
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert sdk.embeddings.create(model="emulated", input=["metrics"]).data
    assert sdk.completions.create(model="tiny", prompt="Once upon", max_tokens=4).usage.completion_tokens
    chat = [{"role": "user", "content": "Hello"}]
    assert sdk.chat.completions.create(model="tiny", messages=chat, max_tokens=4).choices
    stream = sdk.chat.completions.create(model="tiny", messages=chat, max_tokens=4, stream=True,
                                         stream_options={"include_usage": True})
    assert [chunk.usage for chunk in stream][-1] is not None
    assert list(sdk.completions.create(model="proxy", prompt="Hi", max_tokens=4, stream=True))
    tensor = np.ones((1, 16), np.float32)
    http_client = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    given = triton_http.InferInput("INPUT0", [1, 16], "FP32")
    given.set_data_from_numpy(tensor)
    answered = http_client.infer("emulated", [given], headers={"Authorization": f"Bearer {KEY}"})
    assert answered.as_numpy("OUTPUT0") is not None
    grpc_client = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    given_grpc = triton_grpc.InferInput("INPUT0", [1, 16], "FP32")
    given_grpc.set_data_from_numpy(tensor * 2)
    answered_grpc = grpc_client.infer("emulated", [given_grpc], headers={"authorization": f"Bearer {KEY}"})
    assert answered_grpc.as_numpy("OUTPUT0") is not None
    refused = httpx.post(f"{server.url}/v1/embeddings", json={"model": "emulated", "input": [7, "x"]},
                         headers={"Authorization": f"Bearer {KEY}"})
    assert refused.status_code == 400
    limited = [httpx.post(f"{server.url}/v1/embeddings", json={"model": "emulated", "input": f"limited {i}"},
                          headers={"Authorization": f"Bearer {LIMITED_KEY}"}).status_code for i in range(2)]
    assert limited == [200, 429]
    lines = [json.dumps({"custom_id": f"item-{i}", "method": "POST", "url": "/v1/embeddings",
                         "body": {"model": "emulated", "input": f"batch item {i}"}}) for i in range(3)]
    uploaded = sdk.files.create(file=("items.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    eventually(lambda: sdk.batches.retrieve(batch.id).status == "completed", "the batch job", timeout_s=60)


@pytest.fixture(scope="module")
def busy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with tenants, gRPC and an `openai-upstream` model, after traffic of every kind."""
    repo = write_tiny_lm_model(write_emulated_model(tmp_path_factory.mktemp("models"), alpha_ms=1, beta_ms=0.1),
                               "tiny")
    with UpstreamServer() as upstream:
        (repo / "proxy" / "1").mkdir(parents=True)
        (repo / "proxy" / "model.toml").write_text(
            f'kind = "openai-upstream"\n[slo]\ndefault_ms = 60000\n[upstream]\nurl = "http://127.0.0.1:{upstream.port}/v1"\n')
        tenants = repo.parent / "tenants.toml"
        tenants.write_text(f'[tenants.acme]\napi_keys = ["{hash_key(KEY)}"]\n\n'
                           f'[tenants.limited]\napi_keys = ["{hash_key(LIMITED_KEY)}"]\nrequests_per_min = 1\n')
        grpc_port = free_port()
        server = start_server(repo, tmp_path_factory.mktemp("logs"), "--tenants", str(tenants),
                              "--grpc-port", str(grpc_port))
        try:
            _serve_traffic(server, grpc_port)
            yield server
        finally:
            server.stop()


def test_promtool_finds_nothing_wrong_with_the_gateways_metrics(busy_server: ServerProcess) -> None:
    wanted = {"sluice_requests_total", "sluice_batch_items_total", "sluice_tenant_rejected_total",
              "sluice_time_to_first_token_seconds"} | VLLM_NAMES
    scraped: list[str] = []

    def has_every_family() -> bool:
        # the engines' gauges are written with a worker's report (about once a second), so a
        # scrape right after the traffic may come before the first
        scraped[:] = [httpx.get(f"{busy_server.url}/metrics").text]
        return wanted <= set(_families(scraped[0]))

    eventually(has_every_family, "every family in /metrics", timeout_s=30)
    assert _promtool_lints(scraped[0]) == []


def _documented_names() -> set[str]:
    """Every metric name the README gives in backquotes: `sluice_x_total{model,version}` or
    `sluice_x_total{outcome="failed"}` (labels dropped), `sluice_{a,b}_total` (both names)."""
    names: set[str] = set()
    for quoted in re.findall(r"`((?:sluice_|vllm:)[\w:{},=\"|-]*)", README.read_text()):
        quoted = re.sub(r"\{[^{}]*\}$", "", quoted)  # trailing braces are labels (`{outcome="failed"}` too)
        pending = [quoted]
        while pending:
            name = pending.pop()
            found = re.search(r"\{([\w,]+)\}", name)
            if found is None:
                names.add(name)
            else:
                pending += [name[:found.start()] + part + name[found.end():] for part in found.group(1).split(",")]
    return names


def _declared_names() -> set[str]:
    return {f"{value._name}_total" if isinstance(value, prometheus_client.Counter) else value._name
            for value in vars(metrics).values() if isinstance(value, prometheus_client.metrics.MetricWrapperBase)}


def test_every_exported_family_is_documented_and_every_documented_one_exists(busy_server: ServerProcess) -> None:
    documented = _documented_names() - {"sluice_emulated"}  # a platform name, not a metric
    exported = {name for name in _families(httpx.get(f"{busy_server.url}/metrics").text)
                if name.startswith(("sluice_", "vllm:"))}
    assert len(exported) >= 40
    assert exported - documented == set(), "exported but not in the README"
    # Some families appear only once their event happens (a device failure, a canary): those the
    # README names must at least be declared.
    assert documented - _declared_names() == set(), "in the README but never exported"
    assert _declared_names() - documented == set(), "declared but not in the README"


def test_a_workers_own_metrics_are_its_own_series_and_pass_promtool(tmp_path: Path) -> None:
    """`sluice worker --metrics-port` showed the gateway's unlabelled series at 0 too:
    `sluice_workers_ready 0` on every worker fired SluiceNoWorkersReady (`max by (instance)`)
    for each healthy worker a Prometheus scrapes (deploy/kubernetes/monitoring's PodMonitor)."""
    repo = write_tiny_lm_model(write_emulated_model(tmp_path / "models", alpha_ms=1, beta_ms=0.1), "tiny")
    worker_address, metrics_port, port = f"tcp://127.0.0.1:{free_port()}", free_port(), free_port()
    url, worker_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}"
    processes = [
        subprocess.Popen([sys.executable, "-m", "sluice", "worker", "--bind", worker_address, "--models", str(repo),
                          "--metrics-port", str(metrics_port)],
                         env={**_environment(), "SLUICE_CACHE_DIR": str(tmp_path / "cache")}),
        subprocess.Popen([sys.executable, "-m", "sluice", "gateway", "--worker", worker_address, "--port", str(port)],
                         env=_environment()),
    ]
    try:
        eventually(lambda: httpx.get(f"{url}/v2/health/ready").status_code == 200, "the gateway", timeout_s=120)
        answer = httpx.post(f"{url}/v2/models/emulated/infer", json={"inputs": [
            {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]})
        assert answer.status_code == 200, answer.text
        generated = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3},
                               timeout=60)
        assert generated.status_code == 200, generated.text
        time.sleep(0.5)  # the worker's engine reports its state every few hundred ms
        text = httpx.get(f"{worker_url}/metrics").text
    finally:
        stop_all(processes)
    exported = _families(text)
    assert {"sluice_batch_size", "sluice_device_busy_seconds_total", "vllm:kv_cache_usage_perc"} <= set(exported)
    assert not {"sluice_workers_ready", "sluice_worker_restarts_total", "sluice_cache_entries"} & set(exported)
    own = {name.removesuffix("_total") for name in exported if name.startswith("sluice_")}
    assert own <= metrics._WORKER_FAMILIES, "the gateway's series, at 0, on a worker's /metrics"
    assert _promtool_lints(text) == []


def test_a_worker_is_ready_for_traffic_once_its_models_are_loaded(tmp_path: Path) -> None:
    """A worker listens for gateways before it loads (they see what it is loading), so a probe of
    its RPC port passed at once and a rolling update stopped old workers while the new ones were
    still loading: `/ready` on its metrics port answers 503 until then, 200 after, and the port's
    `/metrics` stays the metrics."""
    repo = add_gated_version(write_emulated_model(tmp_path / "models") / "gated", "1", tmp_path / "gate").parent
    address, metrics_port = f"tcp://127.0.0.1:{free_port()}", free_port()
    ready = f"http://127.0.0.1:{metrics_port}/ready"
    worker = subprocess.Popen([sys.executable, "-m", "sluice", "worker", "--bind", address, "--models", str(repo),
                               "--metrics-port", str(metrics_port)], env=_environment(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        eventually(lambda: (tmp_path / "gate.started").exists(), "the worker loading the gated model", timeout_s=60)
        loading = httpx.get(ready)
        assert (loading.status_code, loading.text) == (503, "loading its models\n")
        host, port = address.removeprefix("tcp://").split(":")
        socket.create_connection((host, int(port)), timeout=5).close()  # listening meanwhile
        (tmp_path / "gate").touch()
        eventually(lambda: httpx.get(ready).status_code == 200, "the worker ready", timeout_s=60)
        assert httpx.get(ready).text == "ready\n"
        assert "sluice_device_busy_seconds_total" in httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
    finally:
        stop_all([worker])
    assert worker.returncode == 0


def _environment() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name != "PROMETHEUS_MULTIPROC_DIR"}

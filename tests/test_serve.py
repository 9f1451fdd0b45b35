"""`sluice serve` start-up: models that fail to load, readiness, and the banner.

A model version refused at load (checksum mismatch, a broken `model.toml`, a runner that cannot
load it) must not hold the others up: the server becomes ready once every model that could load
is ready, the banner lists what was refused and why, and requests for a refused version get a
final 404 that says why instead of a 503 to retry forever.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from sluice.repository import MANIFEST, write_manifest
from tests.conftest import ServerProcess, write_emulated_model

pytestmark = pytest.mark.slow

BODY = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}


def _broken_repository(repo: Path) -> Path:
    write_emulated_model(repo, "good", alpha_ms=1)
    write_emulated_model(repo, "badparam", alpha_ms='"abc"')
    write_emulated_model(repo, "badsum", alpha_ms=1)
    for version in ("1", "2"):
        folder = repo / "badsum" / version
        folder.mkdir(exist_ok=True)
        (folder / "weights.bin").write_text("weights")
        write_manifest(folder, folder / MANIFEST)
    (repo / "badsum" / "1" / "weights.bin").write_text("tampered")
    write_emulated_model(repo, "badtype", alpha_ms=1)
    config = repo / "badtype" / "model.toml"
    config.write_text(config.read_text().replace("max_batch_size = 32", 'max_batch_size = "32"'))
    write_emulated_model(repo, "badseed", alpha_ms=1, seed='"x"')  # the runner raises ValueError while loading
    write_emulated_model(repo, "badtoml", alpha_ms=1)
    (repo / "badtoml" / "model.toml").write_text("kind = [\n")
    return repo


def _banner(server: ServerProcess, timeout_s: float = 60.0) -> list[str]:
    """The banner's lines from the server's log, once its last line is out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = server.log().splitlines()
        if any(line.startswith("  curl ") and line.endswith("/metrics") for line in lines):
            return lines
        time.sleep(0.1)
    raise AssertionError(f"no banner within {timeout_s} s:\n{server.log()}")


def _kserve_error(response: httpx.Response, status: int, *fragments: str) -> str:
    assert response.status_code == status, response.text
    message = response.json()["error"]
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_models_that_fail_to_load_are_refused_with_why_and_the_others_serve(make_server, tmp_path):
    server = make_server(_broken_repository(tmp_path / "models"))  # waits for /v2/health/ready: 200
    url = server.url

    assert httpx.post(f"{url}/v2/models/good/infer", json=BODY).json()["outputs"][0]["data"] == [10.0]
    assert httpx.post(f"{url}/v2/models/badsum/infer", json=BODY).json()["model_version"] == "2"
    assert httpx.get(f"{url}/v2/health/ready").json() == {"ready": True}

    # refused: a final 404 naming the reason, not a 503 to retry
    response = httpx.post(f"{url}/v2/models/badparam/infer", json=BODY)
    _kserve_error(response, 404, "'badparam'", "failed to load", "bad emulator parameter", "'abc'")
    assert "retry-after" not in response.headers
    _kserve_error(httpx.post(f"{url}/v2/models/badsum/versions/1/infer", json=BODY), 404, "checksum mismatch")
    _kserve_error(httpx.get(f"{url}/v2/models/badsum/versions/1"), 404, "checksum mismatch")
    _kserve_error(httpx.get(f"{url}/v2/models/badsum/versions/1/ready"), 404, "checksum mismatch")
    _kserve_error(httpx.get(f"{url}/v2/models/badtype/ready"), 404, "model.toml", "max_batch_size", "'32'")
    _kserve_error(httpx.get(f"{url}/v2/models/badtoml"), 404, "model.toml", "not valid TOML")
    _kserve_error(httpx.post(f"{url}/v2/models/badseed/infer", json=BODY), 404, "loading failed: ValueError")
    error = httpx.get(f"{url}/v1/models/badparam").json()["error"]
    assert error["code"] == "model_load_failed" and "abc" in error["message"]

    # a model with a refused version lists it beside the ready ones
    metadata = httpx.get(f"{url}/v2/models/badsum").json()
    assert metadata["versions"] == ["2"]
    [refused] = metadata["refused"]
    assert refused["version"] == "1" and "checksum mismatch" in refused["reason"]
    ready = httpx.get(f"{url}/v2/models/badsum/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True and ready.json()["refused"] == [refused]

    lines = _banner(server)
    assert any(f"listening on {url}" in line for line in lines)
    assert any("ready: good v1" in line for line in lines)
    for name, reason in [("badparam v1", "bad emulator parameter"), ("badsum v1", "checksum mismatch"),
                         ("badtype v1", "max_batch_size"), ("badtoml v1", "not valid TOML"),
                         ("badseed v1", "ValueError")]:
        assert any(line.startswith(f"  refused: {name}: ") and reason in line for line in lines), name
    # the examples are whole commands, each on one line, even though the log is not a terminal
    [infer] = [line for line in lines if "/infer" in line and line.startswith("  curl ")]
    assert infer.endswith("""[1, 2, 3, 4]}]}'""")


def test_port_0_is_served_on_a_free_port_that_the_banner_names(tmp_path):
    repo = write_emulated_model(tmp_path / "models", alpha_ms=1)
    log_path = tmp_path / "serve.log"
    env = {key: value for key, value in os.environ.items() if key != "PROMETHEUS_MULTIPROC_DIR"}
    process = subprocess.Popen([sys.executable, "-m", "sluice", "serve", "--models", str(repo), "--port", "0"],
                               stdout=log_path.open("wb"), stderr=subprocess.STDOUT, env=env)
    server = ServerProcess("", 0, process, log_path)
    try:
        lines = _banner(server)
        [url] = [m.group(1) for line in lines if (m := re.search(r"listening on (http://\S+)", line))]
        assert not url.endswith(":0")
        ready = httpx.get(f"{url}/v2/health/ready")
        assert ready.json() == {"ready": True}
        # idle connections are kept longer than load balancers keep theirs, and clients are told
        assert ready.headers["keep-alive"] == "timeout=75"
        assert any(line.startswith(f"  curl {url}/v2/models/emulated/infer") for line in lines)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def test_the_banners_examples_send_a_key_when_the_server_asks_for_one():
    """Under a tenants file a keyless curl is a 401: the examples take the key from the
    environment (never holding one), and /metrics' from its own when it needs one."""
    from sluice import wire
    from sluice.serve import _examples

    spec = wire.TensorSpec("INPUT0", "FP32", (-1, -1))
    info = wire.ModelInfo(name="emulated", version="1", kind="emulated", platform="sluice_emulated", inputs=(spec,),
                          outputs=(wire.TensorSpec("OUTPUT0", "FP32", (-1,)),), max_batch_size=32, slo_s=0.09,
                          accepts_text=True, accepts_tensor=True)
    models = {"emulated": {"1": info}}
    url = "http://127.0.0.1:8000"
    open_lines = _examples(url, models)
    assert not any("Authorization" in line or "--key" in line for line in open_lines)
    keyed = _examples(url, models, needs_key=True, metrics_need_key=True)
    curls = [line for line in keyed if line.startswith("  curl ")]
    assert len(curls) == 3
    for line in curls[:2]:  # the inference examples
        assert '-H "Authorization: Bearer $SLUICE_API_KEY"' in line, line
    assert curls[2] == f'  curl {url}/metrics -H "Authorization: Bearer $SLUICE_METRICS_KEY"'
    assert any(line.startswith(f'  sluice top --url {url} --key "$SLUICE_METRICS_KEY"') for line in keyed)
    tenant_only = _examples(url, models, needs_key=True)
    assert f"  curl {url}/metrics" in tenant_only  # /metrics is open unless [metrics] access = "keys"


def test_the_banner_counts_every_worker_started_with_several_on_one_device(make_server, tmp_path):
    server = make_server(write_emulated_model(tmp_path / "models", alpha_ms=1), "--workers", "3", "--device", "cpu")
    [line] = [line for line in _banner(server) if "listening on" in line]
    assert line.endswith("with 3 worker(s) on cpu"), line
    assert len(server.worker_pids()) == 3

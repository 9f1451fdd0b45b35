"""Health probes of a real `sluice serve` while its models load: live at once, ready (503 until
then) once they are, on the KServe paths and on `/health`, where vLLM, TGI and SGLang answer
them (the path probes written for those servers use); no API key asked for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from sluice.gateway.tenants import hash_key
from tests.conftest import ServerProcess, eventually, free_port, write_emulated_model
from tests.user_models import add_gated_version

pytestmark = pytest.mark.slow


def test_live_at_once_ready_once_the_models_are_on_every_health_path(tmp_path: Path) -> None:
    repo = write_emulated_model(tmp_path / "models", alpha_ms=1, beta_ms=0.1)
    gate = tmp_path / "gate"
    add_gated_version(repo / "gated", "1", gate)
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.acme]\napi_keys = ["{hash_key("sk-health-test")}"]\n')
    port = free_port()
    log = tmp_path / "serve.log"
    process = subprocess.Popen([sys.executable, "-m", "sluice", "serve", "--models", str(repo), "--port", str(port),
                                "--tenants", str(tenants)], stdout=log.open("wb"), stderr=subprocess.STDOUT)
    server = ServerProcess(f"http://127.0.0.1:{port}", port, process, log)
    try:
        eventually(lambda: Path(f"{gate}.started").exists(), "the gated model's load to start", timeout_s=60)
        eventually(lambda: httpx.get(f"{server.url}/v2/health/live").status_code == 200, "the gateway to listen")
        live = httpx.get(f"{server.url}/v2/health/live")
        assert live.json() == {"live": True}
        for path in ("/v2/health/ready", "/health"):
            loading = httpx.get(f"{server.url}{path}")
            assert (loading.status_code, loading.json()) == (503, {"ready": False}), path
        gate.touch()
        eventually(lambda: httpx.get(f"{server.url}/v2/health/ready").status_code == 200, "the model to load")
        for path in ("/v2/health/ready", "/health"):
            ready = httpx.get(f"{server.url}{path}")
            assert (ready.status_code, ready.json()) == (200, {"ready": True}), path
        assert httpx.get(f"{server.url}/v2/health/live").json() == {"live": True}
    finally:
        server.stop()

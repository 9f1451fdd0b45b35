"""Two gateways (`sluice serve` processes) with one tenants file and one real Redis: the tenant's
requests-per-minute limit holds across both, and a wrong --limits-redis fails at start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from sluice.gateway.tenants import hash_key, new_key
from tests.conftest import write_emulated_model

pytestmark = pytest.mark.slow

KEY = new_key()


def _infer(url: str) -> httpx.Response:
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    return httpx.post(f"{url}/v2/models/emulated/infer", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=30)


def test_a_limit_holds_across_two_gateways_sharing_redis(make_server, tmp_path: Path, redis_url: str) -> None:
    repo = write_emulated_model(tmp_path / "models")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.shared]\napi_keys = ["{hash_key(KEY)}"]\nrequests_per_min = 4\n')
    # a database of its own: other tests share this Redis
    url = redis_url.rsplit("/", 1)[0] + "/3"
    first = make_server(repo, "--tenants", str(tenants), "--limits-redis", url)
    second = make_server(repo, "--tenants", str(tenants), "--limits-redis", url)
    answers = [_infer(server.url) for server in (first, second, first, second, first, second)]
    assert [a.status_code for a in answers] == [200, 200, 200, 200, 429, 429]
    refused = answers[-1]
    assert refused.headers["x-ratelimit-limit-requests"] == "4"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert float(refused.headers["retry-after"]) > 0


def test_an_unreachable_redis_fails_at_start(tmp_path: Path) -> None:
    repo = write_emulated_model(tmp_path / "models")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.t]\napi_keys = ["{hash_key(KEY)}"]\n')
    done = subprocess.run([sys.executable, "-m", "sluice", "serve", "--models", str(repo), "--port", "0",
                           "--tenants", str(tenants), "--limits-redis", "redis://127.0.0.1:1/0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "cannot reach the Redis for shared limits" in done.stderr + done.stdout

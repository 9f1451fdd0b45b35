"""Starting a `sluice serve` for a benchmark script and waiting until it is ready."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx


def start_server(models: Path, port: int, log_path: Path, *extra: str) -> subprocess.Popen[bytes]:
    """`sluice serve --models MODELS --port PORT EXTRA...`, its output in `log_path`; exits the
    script if it is not ready within two minutes."""
    log = log_path.open("wb")
    server = subprocess.Popen([sys.executable, "-m", "sluice", "serve", "--models", str(models), "--port", str(port),
                               *extra], stdout=log, stderr=subprocess.STDOUT)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            break
        time.sleep(0.2)
    server.kill()
    sys.exit(f"the server did not start; see {log_path}")

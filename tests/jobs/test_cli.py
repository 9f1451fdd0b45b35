"""`sluice batch`'s client: it follows a job across a server restart instead of giving up, and
its exit status says whether every request succeeded."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import click
import pytest

from sluice.jobs.cli import _Api, _follow


class _Batches(BaseHTTPRequestHandler):
    """GET /v1/batches/b1 answers each of `answers` in turn: (status, batch status, headers)."""

    answers: list[tuple[int, str, dict[str, str]]] = []

    def do_GET(self) -> None:
        status, batch_status, headers = self.answers.pop(0)
        body = json.dumps({"id": "b1", "status": batch_status, "request_counts": {"total": 2, "completed": 1}}
                          if status == 200 else {"error": {"message": "restarting"}}).encode()
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _serve(port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), _Batches)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_following_a_job_rides_out_a_server_restart():
    """Seen: `sluice batch submit --wait` exited 1 ('cannot reach ...: Connection refused') when the
    server was restarted mid-job, though the job went on there. Now the client waits: through
    connection refusals and 502/503 (their Retry-After honoured), up to its patience."""
    port = _free_port()
    _Batches.answers = [(200, "in_progress", {})]
    servers = [_serve(port)]
    waits: list[float] = []

    def sleep(seconds: float) -> None:  # the server comes back while the client waits
        waits.append(seconds)
        if len(waits) == 1:
            _Batches.answers = [(503, "", {"retry-after": "0"}), (502, "", {}), (200, "completed", {})]
            servers.append(_serve(port))

    api = _Api(f"http://127.0.0.1:{port}", None, patience_s=30, sleep=sleep)
    assert api.json("GET", "/v1/batches/b1")["status"] == "in_progress"
    servers[0].shutdown()
    servers[0].server_close()  # connection refused from here until the sleep brings a server back
    try:
        assert _follow(api, "b1")["status"] == "completed"
    finally:
        servers[-1].shutdown()
        servers[-1].server_close()
    assert len(waits) == 3 and waits[1] == 0.0  # refused, then 503 with Retry-After: 0, then 502


def test_a_server_never_reached_or_a_client_error_fails_at_once():
    waits: list[float] = []
    api = _Api(f"http://127.0.0.1:{_free_port()}", None, patience_s=30, sleep=waits.append)
    with pytest.raises(click.ClickException, match="cannot reach"):
        api.json("GET", "/v1/batches/b1")  # a wrong --url: no waiting for a server that never answered
    port = _free_port()
    _Batches.answers = [(404, "", {})]
    server = _serve(port)
    try:
        with pytest.raises(click.ClickException, match="HTTP 404"):
            _Api(f"http://127.0.0.1:{port}", None, patience_s=30, sleep=waits.append).json("GET", "/v1/batches/b1")
    finally:
        server.shutdown()
        server.server_close()
    assert waits == []


def _embedding_line(custom_id: str, model: str = "emulated", **extra: object) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
                       "body": {"model": model, "input": "hello", **extra}})


def _submit_and_wait(url: str, tmp_path: Path, lines: list[str]) -> subprocess.CompletedProcess[str]:
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    return subprocess.run([sys.executable, "-m", "sluice", "batch", "submit", str(source), "--endpoint",
                           "/v1/embeddings", "--wait", "--url", url, "--output", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SLUICE_API_KEY": "", "OPENAI_API_KEY": ""})


def test_submit_wait_exits_non_zero_unless_every_request_succeeded(make_server, emulated_repo, tmp_path: Path):
    """Seen: `sluice batch submit --wait` exited 0 for a job whose every request failed (the job
    itself 'completed'), so a script could not tell. Now: 0 only when all succeeded, 3 when some
    failed (their lines in the errors file), 1 when the job did not complete (here: failed at
    validation)."""
    server = make_server(emulated_repo(alpha_ms=1.0, beta_ms=0.1))
    succeeded = _submit_and_wait(server.url, tmp_path, [_embedding_line("a"), _embedding_line("b")])
    assert succeeded.returncode == 0, succeeded.stderr
    all_failed = _submit_and_wait(server.url, tmp_path, [_embedding_line("a", encoding_format="bogus"),
                                                         _embedding_line("b", encoding_format="bogus")])
    assert all_failed.returncode == 3, all_failed.stderr
    assert "2 of 2 requests failed" in all_failed.stderr
    errors = list((tmp_path / "out").glob("*_errors.jsonl"))
    assert len(errors) == 1 and len(errors[0].read_text().splitlines()) == 2
    some_failed = _submit_and_wait(server.url, tmp_path, [_embedding_line("a"),
                                                          _embedding_line("b", encoding_format="bogus")])
    assert some_failed.returncode == 3 and "1 of 2 requests failed" in some_failed.stderr
    rejected = _submit_and_wait(server.url, tmp_path, [_embedding_line("a", model="no-such-model")])
    assert rejected.returncode == 1 and "failed" in rejected.stderr
    assert "model_not_found" in rejected.stderr  # the validation error, line by line


def test_a_refused_key_says_which_key_to_give_and_the_servers_message_not_its_json(make_server, emulated_repo,
                                                                                    tmp_path: Path):
    from sluice.gateway.tenants import hash_key, new_key

    admin_key = new_key()
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[admin]\napi_keys = ["{hash_key(admin_key)}"]\n[tenants.a]\napi_keys = []\n')
    server = make_server(emulated_repo(alpha_ms=1.0, beta_ms=0.1), "--tenants", str(tenants))
    env = {**os.environ, "SLUICE_API_KEY": "", "OPENAI_API_KEY": ""}
    for key, said in (("", "HTTP 401: this server needs an API key"),
                      (admin_key, "HTTP 403: an admin key manages tenants; it cannot run inference")):
        run = subprocess.run([sys.executable, "-m", "sluice", "batch", "status", "batch_x", "--url", server.url,
                              "--api-key", key], capture_output=True, text=True, timeout=120, env=env)
        assert run.returncode == 1, run.stderr
        assert run.stderr.startswith(f"Error: GET /v1/batches/batch_x: {said}")
        assert run.stderr.strip().endswith("; give a tenant's key with --api-key or $SLUICE_API_KEY")
        assert '{"error"' not in run.stderr and "Traceback" not in run.stderr

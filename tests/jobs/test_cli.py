"""`sluice batch`'s client: it follows a job across a server restart instead of giving up."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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

"""A worker's HTTP port for Prometheus and Kubernetes (`sluice worker --metrics-port`): `/metrics`,
and `/ready`, which a readiness or startup probe asks.

A worker listens for gateways before it loads its models (they see what it is loading), so its RPC
port being open says nothing about whether it can serve. `/ready` answers 200 only once the models
it starts with are loaded (or refused) and until it drains; 503 before and after. A rolling update
then waits for a new worker's models before it stops an old one."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

READY_PATH = "/ready"


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Not a line per scrape or probe on stderr."""


def serve_probes(port: int, registry: CollectorRegistry, is_ready: Callable[[], str | None],
                 host: str = "0.0.0.0") -> ThreadingWSGIServer:
    """Serve `/metrics` (and any other path, as `prometheus_client` does) from `registry`, and `/ready`
    from `is_ready`: None when ready, else why not (the 503's body), in a daemon thread; raises
    `OSError` when the port cannot be had."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != READY_PATH:
            return metrics(environ, start_response)
        why_not = is_ready()
        start_response("200 OK" if why_not is None else "503 Service Unavailable",
                       [("Content-Type", "text/plain; charset=utf-8")])
        return [f"{why_not or 'ready'}\n".encode()]

    server = make_server(host, port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics and probes", daemon=True).start()
    return server

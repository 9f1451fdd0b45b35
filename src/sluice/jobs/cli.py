"""`sluice batch`: submit a JSONL file as a batch job, follow it with a progress bar, fetch its results.

Talks to a running server over HTTP with the standard library only (no client dependency).
"""

from __future__ import annotations

import json
import secrets
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from sluice.server_url import check_server_url

_FINAL = {"completed", "failed", "cancelled", "expired"}
_TRANSIENT_STATUSES = frozenset({429, 502, 503, 504})
PATIENCE_S = 300.0
"""How long a call keeps trying while the server is unreachable or answers 429/502/503/504 (it is
restarting: the job goes on there), before the command gives up. Every call may be repeated: the
submit's upload and create carry an idempotency key, the rest are reads. A server never reached
(a wrong --url) is an error at once."""


class _Api:
    def __init__(self, url: str, api_key: str | None, patience_s: float = PATIENCE_S,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.base = url.rstrip("/")
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.patience_s = patience_s
        self._sleep = sleep
        self._has_answered = False

    def call(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> bytes:
        deadline = time.monotonic() + self.patience_s
        for attempt in range(1_000_000):
            try:
                return self._call_once(method, path, body, headers)
            except _Transient as exc:
                if not self._has_answered:
                    raise click.ClickException(exc.message) from None
                wait_s = exc.retry_after_s if exc.retry_after_s is not None else min(0.5 * 2 ** attempt, 5.0)
                if time.monotonic() + wait_s > deadline:
                    raise click.ClickException(exc.message) from None
                self._sleep(wait_s)
        raise AssertionError("unreachable")

    def _call_once(self, method: str, path: str, body: bytes | None, headers: dict[str, str] | None) -> bytes:
        request = urllib.request.Request(f"{self.base}{path}", data=body, method=method,
                                         headers={**self.headers, **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                self._has_answered = True
                return bytes(response.read())
        except urllib.error.HTTPError as exc:
            self._has_answered = True
            message = f"{method} {path}: HTTP {exc.code}: {_error_message(exc.read())}"
            if exc.code in (401, 403):
                message += "; give a tenant's key with --api-key or $SLUICE_API_KEY"
            if exc.code in _TRANSIENT_STATUSES:
                raise _Transient(message, _retry_after_s(exc.headers.get("retry-after"))) from exc
            raise click.ClickException(message) from exc
        except (urllib.error.URLError, ConnectionError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise _Transient(f"cannot reach {self.base}: {reason}", None) from exc

    def json(self, method: str, path: str, payload: dict[str, Any] | None = None,
             headers: dict[str, str] | None = None) -> dict[str, Any]:
        body = json.dumps(payload).encode() if payload is not None else None
        extra = {"content-type": "application/json", **(headers or {})} if body is not None else headers
        result: dict[str, Any] = json.loads(self.call(method, path, body, extra))
        return result

    def upload(self, path: Path, idempotency_key: str) -> dict[str, Any]:
        boundary = secrets.token_hex(16)
        body = b"".join((
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'.encode(),
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{path.name}"\r\n'
            "Content-Type: application/jsonl\r\n\r\n".encode(), path.read_bytes(), f"\r\n--{boundary}--\r\n".encode(),
        ))
        headers = {"content-type": f"multipart/form-data; boundary={boundary}", "idempotency-key": idempotency_key}
        result: dict[str, Any] = json.loads(self.call("POST", "/v1/files", body, headers))
        return result


def _server(command: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """--url and --api-key, read from the environment as `SLUICE_BATCH_<COMMAND>_<OPTION>` like
    every option (naming a variable turns click's own lookup off), else `SLUICE_URL`, and the key
    from `SLUICE_API_KEY` or `OPENAI_API_KEY` as `sluice bench` reads it."""
    prefix = f"SLUICE_BATCH_{command.upper()}_"

    def decorate(function: Callable[..., None]) -> Callable[..., None]:
        function = click.option("--api-key", default=None, show_envvar=True,
                                envvar=[f"{prefix}API_KEY", "SLUICE_API_KEY", "OPENAI_API_KEY"],
                                help="Bearer key, when the server has tenants.")(function)
        return click.option("--url", default="http://127.0.0.1:8000", show_default=True, show_envvar=True,
                            envvar=[f"{prefix}URL", "SLUICE_URL"], callback=check_server_url,
                            help="The sluice server.")(function)

    return decorate


def _error_message(body: bytes) -> str:
    """The message of an answer's OpenAI error envelope; else its start, as it came."""
    detail = body.decode(errors="replace")
    try:
        error = json.loads(detail)["error"]
        return str(error["message"] if isinstance(error, dict) else error)
    except (ValueError, KeyError, TypeError):
        return detail[:500]


class _Transient(Exception):
    def __init__(self, message: str, retry_after_s: float | None) -> None:
        super().__init__(message)
        self.message, self.retry_after_s = message, retry_after_s


def _retry_after_s(value: str | None) -> float | None:
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return min(max(seconds, 0.0), 60.0) if seconds is not None else None


@click.group()
def batch() -> None:
    """Batch jobs: submit a JSONL file, follow it, fetch its results."""


@batch.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--endpoint", required=True,
              help="/v1/embeddings, /v1/completions, /v1/chat/completions, /v1/responses or /v2/infer.")
@click.option("--window", "completion_window", default="24h", show_default=True,
              help="Completion window: hours, minutes or seconds (24h, 30m, 90s); past it the job expires.")
@click.option("--wait", is_flag=True,
              help="Show progress until the job ends, then download its files. Exit status: 0 when every "
                   "request succeeded, 1 when the job failed, expired or was cancelled (or the command "
                   "failed), 3 when it completed but some requests failed (their lines are in the errors file).")
@click.option("--output", "output_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
              show_default=True, help="Where --wait writes BATCH_output.jsonl / BATCH_errors.jsonl.")
@_server("submit")
def submit(file: Path, endpoint: str, completion_window: str, wait: bool, output_dir: Path, url: str,
           api_key: str | None) -> None:
    """Upload FILE and create a batch job from it."""
    api = _Api(url, api_key)
    key = secrets.token_hex(16)  # a retried submit never makes a second job
    uploaded = api.upload(file, f"file-{key}")
    job = api.json("POST", "/v1/batches", {"input_file_id": uploaded["id"], "endpoint": endpoint,
                                           "completion_window": completion_window}, {"idempotency-key": key})
    click.echo(job["id"])
    if wait:
        job = _follow(api, job["id"])
        _download(api, job, output_dir)
        sys.exit(exit_status(job))


EXIT_UNFINISHED = 1
"""`submit --wait`: the job failed, expired or was cancelled (also click's status for a failed command)."""
EXIT_SOME_FAILED = 3
"""`submit --wait`: the job completed, but some of its requests failed (2 is click's usage error)."""


def exit_status(job: dict[str, Any]) -> int:
    """0 only when the job completed and every request in it succeeded; says why on stderr otherwise."""
    counts = job.get("request_counts") or {}
    num_failed, num_total = counts.get("failed", 0), counts.get("total", 0)
    if job["status"] != "completed":
        click.echo(f"batch {job['id']} {job['status']}: {counts.get('completed', 0)} of {num_total} requests "
                   "succeeded", err=True)
        return EXIT_UNFINISHED
    if num_failed:
        click.echo(f"batch {job['id']} completed, but {num_failed} of {num_total} requests failed", err=True)
        return EXIT_SOME_FAILED
    return 0


@batch.command()
@click.argument("batch_id")
@_server("status")
def status(batch_id: str, url: str, api_key: str | None) -> None:
    """Show a batch job's status and counts."""
    job = _Api(url, api_key).json("GET", f"/v1/batches/{batch_id}")
    counts = job.get("request_counts") or {}
    click.echo(f"{job['id']}  {job['status']}  {counts.get('completed', 0)} ok, {counts.get('failed', 0)} failed "
               f"of {counts.get('total', 0)}")
    for error in (job.get("errors") or {}).get("data") or []:
        click.echo(f"  line {error.get('line')}: {error.get('code')}: {error.get('message')}")
    for name in ("output_file_id", "error_file_id"):
        if job.get(name):
            click.echo(f"  {name}: {job[name]}")


def _follow(api: _Api, batch_id: str) -> dict[str, Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task(batch_id, total=None)
        while True:
            job = api.json("GET", f"/v1/batches/{batch_id}")
            counts = job.get("request_counts") or {}
            progress.update(task, total=counts.get("total") or None,
                            completed=counts.get("completed", 0) + counts.get("failed", 0),
                            description=f"{batch_id} {job['status']}")
            if job["status"] in _FINAL:
                return job
            time.sleep(0.5)


def _download(api: _Api, job: dict[str, Any], output_dir: Path) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    for name, suffix in (("output_file_id", "output"), ("error_file_id", "errors")):
        if job.get(name):
            target = output_dir / f"{job['id']}_{suffix}.jsonl"
            target.write_bytes(api.call("GET", f"/v1/files/{job[name]}/content"))
            click.echo(f"{suffix}: {target}")
    if job["status"] == "failed":
        for error in (job.get("errors") or {}).get("data") or []:
            click.echo(f"line {error.get('line')}: {error.get('code')}: {error.get('message')}", err=True)

"""OpenAI Files and Batch APIs, over the durable job store.

    POST /v1/files (multipart: file, purpose=batch)   GET /v1/files?purpose=&limit=&after=&order=
    GET /v1/files/{id}   GET /v1/files/{id}/content   DELETE /v1/files/{id}
    POST /v1/batches   GET /v1/batches?after=&limit=   GET /v1/batches/{id}   POST /v1/batches/{id}/cancel
    GET /v1/batches/{id}/results?order=input   (sluice: every item's line in input order, streamed; on a
                                               running batch it waits for each next line until the end)

`expires_after` on upload (form fields `expires_after[anchor]=created_at`, `expires_after[seconds]`)
and `output_expires_after` on a batch (for its output and error files) set a file's `expires_at`,
1 hour to 30 days after its creation; the executor's housekeeping deletes it then.

Every object belongs to the tenant that created it (`request_tenant`); other tenants get 404.
`Idempotency-Key` on file upload and batch creation returns the original object on a repeat, and a
409 when the key's first request was a different one. A list's `after` that names no object of the
tenant is a 400 (rather than an empty page that looks like the end). Everything is committed to
the store before the answer goes out.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive

from sluice.api.common import (
    decode_json,
    json_response,
    list_response,
    page_limit,
    page_order,
    parse_count,
    read_body,
    request_tenant,
)
from sluice.errors import Conflict, IdempotencyKeyReused, InvalidInput, NotFound, PayloadTooLarge
from sluice.jobs.rows import new_file_id
from sluice.jobs.store import BatchJob, BatchStatus, FileObject, JobStore, NewBatch
from sluice.jobs.validate import ENDPOINTS

MAX_FILE_BYTES = 512 * 1024 * 1024
MAX_WINDOW_S = 14 * 24 * 3600
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
_WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smh])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}
_IDEMPOTENCY_HEADER = "idempotency-key"
_FORM_OVERHEAD_BYTES = 64 * 1024
"""What a multipart upload may hold besides the file: boundaries, part headers, `purpose`."""
_RESULT_PAGE = 1000
_RESULT_POLL_MIN_S = 0.05
_RESULT_POLL_MAX_S = 1.0


MIN_EXPIRES_AFTER_S = 3600
MAX_EXPIRES_AFTER_S = 30 * 86_400
"""OpenAI's bounds on `expires_after.seconds` (files) and `output_expires_after.seconds` (batches)."""


class ExpiresAfter(msgspec.Struct):
    anchor: str
    seconds: int


class CreateBatch(msgspec.Struct):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None


def routes(store: JobStore, notify: Callable[[], None], body_limit_bytes: int,
           max_file_bytes: int = MAX_FILE_BYTES) -> list[Route]:
    async def upload(request: Request) -> Response:
        """The body is counted as it arrives (a chunked upload declares no length): past the cap
        it is refused at once rather than read to its end."""
        too_large = f"files are limited to {max_file_bytes} bytes"
        declared = parse_count(request.headers.get("content-length", ""))
        if declared is not None and declared > max_file_bytes + _FORM_OVERHEAD_BYTES:
            raise PayloadTooLarge(too_large)
        capped = Request(request.scope, _capped(request.receive, max_file_bytes + _FORM_OVERHEAD_BYTES, too_large))
        form = await capped.form(max_files=1, max_fields=8)
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise InvalidInput("'file' must be an uploaded file", param="file")
            if purpose != "batch":
                raise InvalidInput("'purpose' must be 'batch'", param="purpose")
            if upload.size is not None and upload.size > max_file_bytes:
                raise PayloadTooLarge(too_large)
            expires_after_s = _form_expires_after(form.get("expires_after[anchor]"), form.get("expires_after[seconds]"))
            content = await upload.read()
        finally:
            await form.close()
        owner, key, filename = request_tenant(request), _idempotency_key(request), upload.filename or "upload.jsonl"
        file_id, now = new_file_id(), int(time.time())
        created = await store.create_file(owner, filename, "batch", content, now, key, file_id,
                                          None if expires_after_s is None else now + expires_after_s)
        if created.id != file_id and (created.filename != filename or created.bytes != len(content)
                                      or _expires_after_s(created) != expires_after_s
                                      or await store.file_content(owner, created.id) != content):
            assert key is not None  # only an idempotency key finds another file
            raise _key_reused(key, "file")
        return json_response(_file_json(created))

    async def list_files(request: Request) -> Response:
        """OpenAI's `GET /v1/files`: `purpose`, `limit` (1 to 10,000, default 10,000), `order`
        (`desc`, the default, or `asc` by creation), `after` (a file id of this tenant)."""
        owner, query = request_tenant(request), request.query_params
        limit, order = page_limit(query, 10_000, 10_000), page_order(query)
        after = query.get("after")
        if after is not None and await store.get_file(owner, after) is None:
            raise InvalidInput(f"'after' names no file of yours: {after[:100]!r}", param="after")
        page = await store.list_files(owner, query.get("purpose"), after, limit + 1, ascending=order == "asc")
        return list_response([_file_json(f) for f in page[:limit]], len(page) > limit)

    async def get_file(request: Request) -> Response:
        return json_response(_file_json(await _file(store, request)))

    async def file_content(request: Request) -> Response:
        """Streamed a part (a few MiB) at a time: an output file may be larger than memory should hold."""
        found = await _file(store, request)
        first = await store.file_part(found.owner, found.id, 0)
        if first is None:
            raise NotFound(f"no file {found.id!r}")
        return StreamingResponse(_file_parts(store, found, first), media_type="application/jsonl",
                                 headers={"content-length": str(found.bytes)})

    async def delete_file(request: Request) -> Response:
        file_id = request.path_params["file_id"]
        if not await store.delete_file(request_tenant(request), file_id):
            raise NotFound(f"no file {file_id!r}")
        return json_response({"id": file_id, "object": "file", "deleted": True})

    async def create_batch(request: Request) -> Response:
        """A repeat with the same `Idempotency-Key` is answered from the key (the original batch, even
        if its input file is deleted since); the same key with another request is a 409."""
        parsed = decode_json(await read_body(request, body_limit_bytes), CreateBatch)
        owner, key = request_tenant(request), _idempotency_key(request)
        window_s = _check_batch(parsed)
        if key is not None and (original := await store.find_batch(owner, key)) is not None:
            if not _is_same_batch(original, parsed):
                raise _key_reused(key, "batch")
            return json_response(batch_json(original))
        input_file = await store.get_file(owner, parsed.input_file_id)
        if input_file is None:
            raise NotFound(f"no file {parsed.input_file_id!r}")
        if input_file.purpose != "batch":
            raise InvalidInput(f"file {input_file.id!r} has purpose {input_file.purpose!r}; a batch's input file "
                               "must be uploaded with purpose 'batch'", param="input_file_id")
        now = int(time.time())
        output_expires_after_s = parsed.output_expires_after.seconds if parsed.output_expires_after else None
        batch = await store.create_batch(NewBatch(owner, parsed.endpoint, parsed.input_file_id,
                                                  parsed.completion_window, parsed.metadata, now, now + window_s,
                                                  output_expires_after_s), key)
        if key is not None and not _is_same_batch(batch, parsed):  # a concurrent request took the key first
            raise _key_reused(key, "batch")
        notify()
        return json_response(batch_json(batch))

    async def get_batch(request: Request) -> Response:
        return json_response(batch_json(await _batch(store, request)))

    async def list_batches(request: Request) -> Response:
        limit = page_limit(request.query_params, 20, 100)
        owner, after = request_tenant(request), request.query_params.get("after")
        if after is not None and await store.get_batch(owner, after) is None:
            raise InvalidInput(f"'after' names no batch of yours: {after[:100]!r}", param="after")
        page = await store.list_batches(owner, after, limit + 1)
        return list_response([batch_json(b) for b in page[:limit]], len(page) > limit)

    async def cancel_batch(request: Request) -> Response:
        """As OpenAI: a batch validating or in progress turns `cancelling` (a repeat answers it
        again); one finalizing or already final cannot be cancelled: 409."""
        batch = await store.cancel_batch(request_tenant(request), request.path_params["batch_id"], int(time.time()))
        if batch is None:
            raise NotFound(f"no batch {request.path_params['batch_id']!r}")
        if batch.status is not BatchStatus.CANCELLING:
            raise Conflict(f"Cannot cancel a batch with status '{batch.status.value}'.")
        notify()
        return json_response(batch_json(batch))

    async def results(request: Request) -> Response:
        if request.query_params.get("order", "input") != "input":
            raise InvalidInput("'order' must be 'input'", param="order")
        batch = await _batch(store, request)
        return StreamingResponse(_result_stream(store, batch.id), media_type="application/jsonl")

    return [
        Route("/v1/files", upload, methods=["POST"]),
        Route("/v1/files", list_files, methods=["GET"]),
        Route("/v1/files/{file_id}", get_file, methods=["GET"]),
        Route("/v1/files/{file_id}", delete_file, methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
        Route("/v1/batches", create_batch, methods=["POST"]),
        Route("/v1/batches", list_batches, methods=["GET"]),
        Route("/v1/batches/{batch_id}", get_batch, methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
        Route("/v1/batches/{batch_id}/results", results, methods=["GET"]),
    ]


def _capped(receive: Receive, limit_bytes: int, message: str) -> Receive:
    """`receive`, refusing the request once its body passes `limit_bytes`."""
    num_bytes = 0

    async def capped() -> Message:
        nonlocal num_bytes
        received = await receive()
        if received["type"] == "http.request":
            num_bytes += len(received.get("body", b""))
            if num_bytes > limit_bytes:
                raise PayloadTooLarge(message)
        return received

    return capped


async def _file(store: JobStore, request: Request) -> FileObject:
    found = await store.get_file(request_tenant(request), request.path_params["file_id"])
    if found is None:
        raise NotFound(f"no file {request.path_params['file_id']!r}")
    return found


async def _batch(store: JobStore, request: Request) -> BatchJob:
    found = await store.get_batch(request_tenant(request), request.path_params["batch_id"])
    if found is None:
        raise NotFound(f"no batch {request.path_params['batch_id']!r}")
    return found


async def _file_parts(store: JobStore, found: FileObject, first: bytes) -> AsyncIterator[bytes]:
    part: bytes | None = first
    index = 0
    while part is not None:
        if part:
            yield part
        index += 1
        part = await store.file_part(found.owner, found.id, index)


async def _result_stream(store: JobStore, batch_id: str) -> AsyncIterator[bytes]:
    """Every item's line in input order, with no hole: the lines already recorded up to the first
    item still running, then each next one as it is recorded, until the batch is final (items
    cancelled or expired come with their error line). While it waits, the store is asked with a
    few indexed lookups, at first every `_RESULT_POLL_MIN_S`, slowing to `_RESULT_POLL_MAX_S`."""
    after = -1
    poll_s = _RESULT_POLL_MIN_S
    is_final = False
    while True:
        page = await store.result_lines(batch_id, after, _RESULT_PAGE)
        if page:
            yield b"".join(r.line for r in page)
            after = page[-1].idx
            poll_s = _RESULT_POLL_MIN_S
            if len(page) == _RESULT_PAGE:
                continue
        if is_final:  # read once more after seeing it final: every stored item has its line now
            return
        batch = await store.get_batch(None, batch_id)
        is_final = batch is None or not batch.is_active
        if not is_final:
            await asyncio.sleep(poll_s)
            poll_s = min(poll_s * 2, _RESULT_POLL_MAX_S)


def _check_batch(parsed: CreateBatch) -> int:
    """The completion window in seconds. OpenAI accepts "24h"; sluice also takes any whole number of
    hours, minutes or seconds ("1h", "30m", "90s") up to 14 days. Metadata within OpenAI's limits."""
    if parsed.endpoint not in ENDPOINTS:
        raise InvalidInput(f"'endpoint' must be one of {', '.join(ENDPOINTS)}", param="endpoint")
    metadata = parsed.metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidInput(f"'metadata' may hold at most {MAX_METADATA_PAIRS} pairs", param="metadata")
    for name, value in metadata.items():
        if len(name) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidInput(f"'metadata' keys are at most {MAX_METADATA_KEY_CHARS} characters and values at "
                               f"most {MAX_METADATA_VALUE_CHARS} (key {name[:64]!r})", param="metadata")
    if parsed.output_expires_after is not None:
        _check_expires_after(parsed.output_expires_after.anchor, parsed.output_expires_after.seconds,
                             "output_expires_after")
    match = _WINDOW.match(parsed.completion_window)
    window_s = int(match.group(1)) * _UNIT_S[match.group(2)] if match else 0
    if not 1 <= window_s <= MAX_WINDOW_S:
        raise InvalidInput("'completion_window' must be a duration like '24h', '30m' or '90s', at most 14 days "
                           f"(got {parsed.completion_window[:32]!r})", param="completion_window")
    return window_s


def _form_expires_after(anchor: object, seconds: object) -> int | None:
    """A file's `expires_after` from an upload's form (`expires_after[anchor]`, `expires_after[seconds]`,
    as the `openai` SDK sends it): its seconds, None when neither is given."""
    if anchor is None and seconds is None:
        return None
    if not isinstance(anchor, str):
        raise InvalidInput("'expires_after[anchor]' must be given with 'expires_after[seconds]': 'created_at'",
                           param="expires_after[anchor]")
    if not isinstance(seconds, str) or not re.fullmatch(r"[0-9]{1,9}", seconds.strip()):
        raise InvalidInput(f"'expires_after[seconds]' must be a whole number of seconds from {MIN_EXPIRES_AFTER_S} "
                           f"to {MAX_EXPIRES_AFTER_S}", param="expires_after[seconds]")
    return _check_expires_after(anchor, int(seconds), "expires_after")


def _check_expires_after(anchor: str, seconds: int, name: str) -> int:
    """OpenAI's expiration policy: anchored at the file's creation, 1 hour to 30 days after it."""
    if anchor != "created_at":
        raise InvalidInput(f"'{name}' anchor must be 'created_at' (got {anchor[:32]!r})", param=f"{name}[anchor]")
    if not MIN_EXPIRES_AFTER_S <= seconds <= MAX_EXPIRES_AFTER_S:
        raise InvalidInput(f"'{name}' seconds must be from {MIN_EXPIRES_AFTER_S} (1 hour) to {MAX_EXPIRES_AFTER_S} "
                           f"(30 days), got {seconds}", param=f"{name}[seconds]")
    return seconds


def _expires_after_s(f: FileObject) -> int | None:
    return None if f.expires_at is None else f.expires_at - f.created_at


def _idempotency_key(request: Request) -> str | None:
    key = request.headers.get(_IDEMPOTENCY_HEADER)
    if key is not None and not 1 <= len(key) <= 255:
        raise InvalidInput("Idempotency-Key must be 1 to 255 characters", param=_IDEMPOTENCY_HEADER)
    return key


def _is_same_batch(batch: BatchJob, parsed: CreateBatch) -> bool:
    output_expires_after_s = parsed.output_expires_after.seconds if parsed.output_expires_after else None
    return (batch.endpoint, batch.input_file_id, batch.completion_window, batch.metadata or None,
            batch.output_expires_after_s) == (parsed.endpoint, parsed.input_file_id, parsed.completion_window,
                                              parsed.metadata or None, output_expires_after_s)


def _key_reused(key: str, kind: str) -> IdempotencyKeyReused:
    return IdempotencyKeyReused(f"Idempotency-Key {key[:100]!r} was already used for a different {kind} request; "
                                "use a new key for a new request", param=_IDEMPOTENCY_HEADER)






def _file_json(f: FileObject) -> dict[str, Any]:
    return {"id": f.id, "object": "file", "bytes": f.bytes, "created_at": f.created_at, "filename": f.filename,
            "purpose": f.purpose, "status": "processed", "expires_at": f.expires_at, "status_details": None}


def batch_json(b: BatchJob) -> dict[str, Any]:
    return {
        "id": b.id, "object": "batch", "endpoint": b.endpoint, "input_file_id": b.input_file_id,
        "completion_window": b.completion_window, "status": b.status.value,
        "output_file_id": b.output_file_id, "error_file_id": b.error_file_id,
        "errors": {"object": "list", "data": b.errors} if b.errors else None,
        "created_at": b.created_at, "in_progress_at": b.in_progress_at, "expires_at": b.expires_at,
        "finalizing_at": b.finalizing_at, "completed_at": b.completed_at, "failed_at": b.failed_at,
        "expired_at": b.expired_at, "cancelling_at": b.cancelling_at, "cancelled_at": b.cancelled_at,
        "request_counts": {"total": b.num_total, "completed": b.num_completed, "failed": b.num_failed},
        "usage": {"input_tokens": b.input_tokens, "output_tokens": b.output_tokens,
                  "total_tokens": b.input_tokens + b.output_tokens,
                  "input_tokens_details": {"cached_tokens": b.cached_tokens},
                  "output_tokens_details": {"reasoning_tokens": b.reasoning_tokens}},
        "metadata": b.metadata,
    }


"""What both store backends share: table layout, column lists, row <-> value conversion, new ids.

Statements that take parameters are each backend's own, written in its dialect (`?` for SQLite,
`%s` for psycopg), never one rewritten into the other: a text rewrite would also change a `?` or
`%s` that is no placeholder, and would keep PostgreSQL to what SQLite can say. A statement both
dialects say alike is built here from the backend's placeholder (`files_page`).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Any

from sluice.jobs.store import ACTIVE_STATUSES, BatchJob, BatchStatus, FileObject

ACTIVE = ACTIVE_STATUSES
FINAL_STAMP = {
    BatchStatus.COMPLETED: "completed_at",
    BatchStatus.CANCELLED: "cancelled_at",
    BatchStatus.EXPIRED: "expired_at",
}
"""The timestamp column each final status sets."""

# {blob}, {real}, {int} are filled per dialect.
SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes {int} NOT NULL,
    created_at {int} NOT NULL,
    content {blob} NOT NULL,
    idempotency_key TEXT,
    expires_at {int},
    UNIQUE (owner, idempotency_key)
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    metadata TEXT,
    created_at {int} NOT NULL,
    expires_at {int} NOT NULL,
    num_total {int} NOT NULL DEFAULT 0,
    num_completed {int} NOT NULL DEFAULT 0,
    num_failed {int} NOT NULL DEFAULT 0,
    input_tokens {int} NOT NULL DEFAULT 0,
    output_tokens {int} NOT NULL DEFAULT 0,
    in_progress_at {int},
    finalizing_at {int},
    completed_at {int},
    failed_at {int},
    expired_at {int},
    cancelling_at {int},
    cancelled_at {int},
    output_file_id TEXT,
    error_file_id TEXT,
    errors TEXT,
    idempotency_key TEXT,
    seq {int} NOT NULL,
    output_expires_after_s {int},
    cached_tokens {int} NOT NULL DEFAULT 0,
    reasoning_tokens {int} NOT NULL DEFAULT 0,
    UNIQUE (owner, idempotency_key)
);
CREATE INDEX IF NOT EXISTS batches_by_owner ON batches (owner, seq);
CREATE INDEX IF NOT EXISTS files_by_owner ON files (owner, created_at);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status);
CREATE TABLE IF NOT EXISTS items (
    batch_id TEXT NOT NULL,
    idx {int} NOT NULL,
    custom_id TEXT NOT NULL,
    url TEXT NOT NULL,
    body {blob} NOT NULL,
    state TEXT NOT NULL DEFAULT 'queued',
    attempts {int} NOT NULL DEFAULT 0,
    not_before {real} NOT NULL DEFAULT 0,
    lease_token TEXT,
    lease_until {real},
    is_error {int} NOT NULL DEFAULT 0,
    line {blob},
    PRIMARY KEY (batch_id, idx)
);
CREATE INDEX IF NOT EXISTS items_by_state ON items (batch_id, state, idx);
CREATE TABLE IF NOT EXISTS file_parts (
    file_id TEXT NOT NULL,
    part {int} NOT NULL,
    data {blob} NOT NULL,
    PRIMARY KEY (file_id, part)
);
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created_at {int} NOT NULL,
    body {blob} NOT NULL,
    input_items {blob} NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
CREATE TABLE IF NOT EXISTS response_runs (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    request {blob} NOT NULL,
    attempts {int} NOT NULL,
    lease_token TEXT NOT NULL,
    lease_until {real} NOT NULL
);
CREATE INDEX IF NOT EXISTS response_runs_by_lease ON response_runs (lease_until);
CREATE INDEX IF NOT EXISTS response_runs_by_owner ON response_runs (owner);
CREATE TABLE IF NOT EXISTS response_events (
    response_id TEXT NOT NULL,
    seq {int} NOT NULL,
    data {blob} NOT NULL,
    PRIMARY KEY (response_id, seq)
);
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created_at {int} NOT NULL,
    metadata {blob} NOT NULL
);
CREATE TABLE IF NOT EXISTS conversation_items (
    conversation_id TEXT NOT NULL,
    seq {int} NOT NULL,
    id TEXT NOT NULL,
    data {blob} NOT NULL,
    PRIMARY KEY (conversation_id, seq)
);
"""

ADDED_COLUMNS = (("files", "expires_at", "{int}"), ("batches", "output_expires_after_s", "{int}"),
                 ("batches", "cached_tokens", "{int} NOT NULL DEFAULT 0"),
                 ("batches", "reasoning_tokens", "{int} NOT NULL DEFAULT 0"))
"""Columns added to tables after they were first released: a database made before has the table
(`CREATE TABLE IF NOT EXISTS` leaves it as it is), so each backend adds those it lacks at startup."""
AFTER_ADDED_COLUMNS = "CREATE INDEX IF NOT EXISTS files_by_expiry ON files (expires_at)"
"""Indexes on added columns: created once the columns are there."""

UNIQUE_SEQ = "CREATE UNIQUE INDEX IF NOT EXISTS batches_by_seq ON batches (seq)"
"""Each batch has its own `seq` (the list order). Created by each backend once its `seq` values are
unique: SQLite takes `MAX(seq) + 1` inside its one writer's transaction; PostgreSQL numbers them with
an identity column, after renumbering the rows of a table made before it had one."""

FILE_PART_BYTES = 4 << 20
"""A file's content is its `files.content` (part 0) followed by its `file_parts` rows (parts 1, 2, ...)
in order. Uploads (at most 512 MiB) are one value; output and error files, which may pass the
~1 GB that SQLite and PostgreSQL allow in one value, are written in parts of about this size
(whole lines), and read back one part at a time."""

FILE_COLUMNS = "id, owner, filename, purpose, bytes, created_at, expires_at"
BATCH_COLUMNS = ("id, owner, endpoint, input_file_id, completion_window, status, metadata, created_at, "
                 "expires_at, num_total, num_completed, num_failed, input_tokens, output_tokens, "
                 "in_progress_at, finalizing_at, completed_at, failed_at, expired_at, cancelling_at, "
                 "cancelled_at, output_file_id, error_file_id, errors, output_expires_after_s, cached_tokens, "
                 "reasoning_tokens")
_ERRORS = BATCH_COLUMNS.split(", ").index("errors")
ITEM_COLUMNS = "idx, custom_id, url, body, attempts"


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def new_token() -> str:
    return secrets.token_hex(16)


def file_of(row: Sequence[Any]) -> FileObject:
    return FileObject(row[0], row[1], row[2], row[3], int(row[4]), int(row[5]),
                      None if row[6] is None else int(row[6]))


def batch_of(row: Sequence[Any]) -> BatchJob:
    values = list(row)
    values[5] = BatchStatus(values[5])
    values[6] = json.loads(values[6]) if values[6] else None
    values[_ERRORS] = json.loads(values[_ERRORS]) if values[_ERRORS] else None
    return BatchJob(*values)


def files_page(placeholder: str, owner: str, purpose: str | None, after: str | None, limit: int,
               ascending: bool) -> tuple[str, list[Any]]:
    """The query and its parameters for a page of an owner's files, ordered by (created_at, id): ids
    break the ties of files created in the same second. `placeholder` is the backend's parameter
    marker (`?` for SQLite, `%s` for psycopg)."""
    p = placeholder
    query = f"SELECT {FILE_COLUMNS} FROM files WHERE owner = {p}"
    params: list[Any] = [owner]
    if purpose is not None:
        query += f" AND purpose = {p}"
        params.append(purpose)
    if after is not None:
        query += (f" AND (created_at, id) {'>' if ascending else '<'} "
                  f"(SELECT created_at, id FROM files WHERE id = {p} AND owner = {p})")
        params += [after, owner]
    direction = "ASC" if ascending else "DESC"
    return f"{query} ORDER BY created_at {direction}, id {direction} LIMIT {p}", [*params, limit]


def output_expires_at(batch: BatchJob, now: int) -> int | None:
    """When the batch's output and error files, written at `now`, expire (`output_expires_after`)."""
    return None if batch.output_expires_after_s is None else now + batch.output_expires_after_s


def dump_json(value: object) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"))


class PartWriter:
    """Gathers one output or error file's lines into parts of about `FILE_PART_BYTES`."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix
        self.file_id = new_file_id()
        self.num_bytes = 0
        self.num_parts = 0
        self._lines: list[bytes] = []
        self._num_pending = 0

    def add(self, line: bytes) -> bytes | None:
        """The next part, when `line` completes one."""
        self._lines.append(line)
        self._num_pending += len(line)
        self.num_bytes += len(line)
        return self.take() if self._num_pending >= FILE_PART_BYTES else None

    def take(self) -> bytes | None:
        """What is gathered, as the next part (numbered `num_parts` after the call); None if nothing is."""
        if not self._lines:
            return None
        part = b"".join(self._lines)
        self._lines, self._num_pending = [], 0
        self.num_parts += 1
        return part


class ConversationSql:
    """The statements of conversations (`JobStore.*conversation*`), in a backend's parameter style `p`."""

    def __init__(self, p: str) -> None:
        self.insert = f"INSERT INTO conversations (id, owner, created_at, metadata) VALUES ({p}, {p}, {p}, {p})"
        self.get = f"SELECT created_at, metadata FROM conversations WHERE id = {p} AND owner = {p}"
        self.items = f"SELECT data FROM conversation_items WHERE conversation_id = {p} ORDER BY seq"
        self.next_seq = f"SELECT COALESCE(MAX(seq), -1) + 1 FROM conversation_items WHERE conversation_id = {p}"
        self.add_item = f"INSERT INTO conversation_items (conversation_id, seq, id, data) VALUES ({p}, {p}, {p}, {p})"
        self.update = f"UPDATE conversations SET metadata = {p} WHERE id = {p} AND owner = {p}"
        self.delete = f"DELETE FROM conversations WHERE id = {p} AND owner = {p}"
        self.delete_items = f"DELETE FROM conversation_items WHERE conversation_id = {p}"
        self.delete_item = (f"DELETE FROM conversation_items WHERE conversation_id = {p} AND id = {p} AND EXISTS "
                            f"(SELECT 1 FROM conversations WHERE id = {p} AND owner = {p})")

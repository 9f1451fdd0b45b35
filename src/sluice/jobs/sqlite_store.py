"""The embedded job store: one SQLite database in the server's data directory.

- WAL journal, `synchronous=FULL`: a commit is on disk (fsync'd) before the API acknowledges it,
  so even a power loss keeps acknowledged files and batches. The fsync is paid per transaction,
  and the executor claims and records many items per transaction, so it costs little per item.
- Every call runs on one dedicated thread that owns the connection: the event loop never blocks
  and no two statements race.
- File contents live in the database (a BLOB): a file and the batch that refers to it commit
  atomically, and the data directory is one file to back up.
- One server per data directory (an exclusive lock on `jobs.lock`), which is why `release_leases`
  may hand every lease back at startup.
"""

from __future__ import annotations

import asyncio
import fcntl
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from sluice.errors import ConfigError
from sluice.jobs import rows
from sluice.jobs.store import (
    BatchJob,
    BatchStatus,
    Claim,
    Event,
    FileObject,
    Item,
    ItemOutcome,
    LeftoverLine,
    NewBatch,
    NewItem,
    ResponseRun,
    ResultLine,
    StoredConversation,
    StoredResponse,
)

T = TypeVar("T")
_CONVERSATIONS = rows.ConversationSql("?")
_CLAIMABLE_QUEUED = ("SELECT idx, custom_id, url, body, attempts FROM items WHERE batch_id = ? AND state = 'queued' "
                     "AND not_before <= ? ORDER BY idx LIMIT ?")
_BEGIN_FINALIZING = ("UPDATE batches SET status = ?, finalizing_at = ? WHERE id = ? AND status = ? "
                     "AND num_completed + num_failed >= num_total")
_FILE_PART = ("SELECT p.data FROM file_parts p JOIN files f ON f.id = p.file_id WHERE p.file_id = ? AND f.owner = ? "
              "AND p.part = ?")
_FIRST_IN_STATE = "SELECT idx FROM items WHERE batch_id = ? AND state = ? AND idx > ? ORDER BY idx LIMIT 1"
_FORGET_OLD_RUNS = ("DELETE FROM response_runs WHERE id IN (SELECT id FROM responses WHERE created_at < ?)",
                    "DELETE FROM response_events WHERE response_id IN (SELECT id FROM responses WHERE created_at < ?)")
"""The runs and streamed events of background responses past their retention (the responses go next)."""
_RESPONSE_EVENTS = ("SELECT e.seq, e.data FROM response_events e JOIN responses r ON r.id = e.response_id "
                    "WHERE e.response_id = ? AND r.owner = ? AND e.seq > ? ORDER BY e.seq LIMIT ?")
_PUT_EVENT = "INSERT INTO response_events (response_id, seq, data) VALUES (?, ?, ?)"
_PUT_RESPONSE = "INSERT INTO responses (id, owner, created_at, body, input_items) VALUES (?, ?, ?, ?, ?)"
_EXPIRED_FILES = ("DELETE FROM file_parts WHERE file_id IN (SELECT id FROM files WHERE expires_at <= ?)",
                  "DELETE FROM files WHERE expires_at <= ?")
"""Forget the files whose `expires_at` has come, their parts first (one transaction: no other writer
comes between); the last statement's count is theirs."""
_CLAIMABLE_EXPIRED = ("SELECT idx, custom_id, url, body, attempts FROM items WHERE batch_id = ? AND state = 'leased' "
                      "AND lease_until < ? ORDER BY idx LIMIT ?")


class SqliteJobStore:
    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = (data_dir / "jobs.lock").open("w")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            self._lock_file.close()
            raise ConfigError(f"another sluice server already uses the data directory {data_dir}") from exc
        self._path = data_dir / "jobs.sqlite3"
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-jobs-db")
        self._db: sqlite3.Connection | None = None
        self._thread.submit(self._open).result()

    def _open(self) -> None:
        db = sqlite3.connect(self._path, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA busy_timeout=5000")
        db.executescript(rows.SCHEMA.format(blob="BLOB", real="REAL", int="INTEGER"))
        _add_columns(db)
        db.execute(rows.UNIQUE_SEQ)  # one writer (BEGIN IMMEDIATE, one server): MAX(seq) + 1 never repeats
        self._db = db

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def _txn(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._call(self._in_txn, fn, *args)

    def _in_txn(self, fn: Callable[..., T], *args: Any) -> T:
        db = self._db
        assert db is not None
        db.execute("BEGIN IMMEDIATE")
        try:
            result = fn(db, *args)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return result

    async def aclose(self) -> None:
        def close() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        await self._call(close)
        self._thread.shutdown(wait=True)
        self._lock_file.close()

    # -- files -----------------------------------------------------------------------------------

    async def create_file(self, owner: str, filename: str, purpose: str, content: bytes, now: int,
                          idempotency_key: str | None = None, file_id: str | None = None,
                          expires_at: int | None = None) -> FileObject:
        file_id = file_id or rows.new_file_id()

        def create(db: sqlite3.Connection) -> FileObject:
            db.execute("INSERT INTO files (id, owner, filename, purpose, bytes, created_at, content, idempotency_key, "
                       "expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (owner, idempotency_key) DO NOTHING",
                       (file_id, owner, filename, purpose, len(content), now, content, idempotency_key, expires_at))
            if idempotency_key is None:
                row = db.execute(f"SELECT {rows.FILE_COLUMNS} FROM files WHERE id = ?", (file_id,))
            else:
                row = db.execute(f"SELECT {rows.FILE_COLUMNS} FROM files WHERE owner = ? AND idempotency_key = ?",
                                 (owner, idempotency_key))
            return rows.file_of(row.fetchone())

        return await self._txn(create)

    async def get_file(self, owner: str, file_id: str) -> FileObject | None:
        def get(db: sqlite3.Connection) -> FileObject | None:
            row = db.execute(f"SELECT {rows.FILE_COLUMNS} FROM files WHERE id = ? AND owner = ?",
                             (file_id, owner)).fetchone()
            return rows.file_of(row) if row else None

        return await self._call(get, self._db)

    async def file_content(self, owner: str, file_id: str) -> bytes | None:
        def read(db: sqlite3.Connection) -> bytes | None:
            row = db.execute("SELECT content FROM files WHERE id = ? AND owner = ?", (file_id, owner)).fetchone()
            if row is None:
                return None
            parts = db.execute("SELECT data FROM file_parts WHERE file_id = ? ORDER BY part", (file_id,))
            return b"".join([bytes(row[0]), *(bytes(p[0]) for p in parts)])

        return await self._call(read, self._db)

    async def file_part(self, owner: str, file_id: str, part: int) -> bytes | None:
        def read(db: sqlite3.Connection) -> bytes | None:
            if part == 0:
                row = db.execute("SELECT content FROM files WHERE id = ? AND owner = ?", (file_id, owner)).fetchone()
            else:
                row = db.execute(_FILE_PART, (file_id, owner, part)).fetchone()
            return bytes(row[0]) if row else None

        return await self._call(read, self._db)

    async def delete_file(self, owner: str, file_id: str) -> bool:
        def delete(db: sqlite3.Connection) -> bool:
            if db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)).rowcount == 0:
                return False
            db.execute("DELETE FROM file_parts WHERE file_id = ?", (file_id,))
            return True

        return await self._txn(delete)

    async def delete_expired_files(self, now: int) -> int:
        def delete(db: sqlite3.Connection) -> int:
            parts, files = _EXPIRED_FILES
            db.execute(parts, (now,))
            return db.execute(files, (now,)).rowcount

        return await self._txn(delete)

    # -- stored responses ------------------------------------------------------------------------

    async def put_response(self, owner: str, response_id: str, created_at: int, body: bytes,
                           input_items: bytes) -> None:
        def put(db: sqlite3.Connection) -> None:
            db.execute(_PUT_RESPONSE, (response_id, owner, created_at, body, input_items))

        await self._txn(put)

    async def put_response_run(self, owner: str, response_id: str, created_at: int, body: bytes, input_items: bytes,
                               request: bytes, token: str, lease_until: float, events: Sequence[Event] = ()) -> None:
        def put(db: sqlite3.Connection) -> None:
            db.execute(_PUT_RESPONSE, (response_id, owner, created_at, body, input_items))
            db.execute("INSERT INTO response_runs (id, owner, request, attempts, lease_token, lease_until) "
                       "VALUES (?, ?, ?, ?, ?, ?)",
                       (response_id, owner, request, 1 if token else 0, token, lease_until))
            db.executemany(_PUT_EVENT, [(response_id, seq, data) for seq, data in events])

        await self._txn(put)

    async def update_response_run(self, response_id: str, token: str, body: bytes | None, *, is_final: bool,
                                  events: Sequence[Event] = ()) -> bool:
        def update(db: sqlite3.Connection) -> bool:
            held = db.execute("SELECT 1 FROM response_runs WHERE id = ? AND lease_token = ?",
                              (response_id, token)).fetchone()
            if held is None:
                return False
            db.executemany(_PUT_EVENT, [(response_id, seq, data) for seq, data in events])
            if body is not None:
                db.execute("UPDATE responses SET body = ? WHERE id = ?", (body, response_id))
            if is_final:
                db.execute("DELETE FROM response_runs WHERE id = ?", (response_id,))
            return True

        return await self._txn(update)

    async def num_response_runs(self, owner: str) -> int:
        def count(db: sqlite3.Connection) -> int:
            return int(db.execute("SELECT COUNT(*) FROM response_runs WHERE owner = ?", (owner,)).fetchone()[0])

        return await self._call(count, self._db)

    async def response_events(self, owner: str, response_id: str, after: int, limit: int) -> list[Event]:
        def read(db: sqlite3.Connection) -> list[Event]:
            found = db.execute(_RESPONSE_EVENTS, (response_id, owner, after, limit))
            return [(int(row[0]), bytes(row[1])) for row in found]

        return await self._call(read, self._db)

    async def cancel_response_run(self, owner: str, response_id: str, body: bytes) -> bool:
        def cancel(db: sqlite3.Connection) -> bool:
            if db.execute("DELETE FROM response_runs WHERE id = ? AND owner = ?", (response_id, owner)).rowcount == 0:
                return False
            db.execute("UPDATE responses SET body = ? WHERE id = ?", (body, response_id))
            return True

        return await self._txn(cancel)

    async def renew_response_runs(self, token: str, response_ids: Sequence[str], lease_until: float) -> set[str]:
        def renew(db: sqlite3.Connection) -> set[str]:
            held = set()
            for response_id in response_ids:
                if db.execute("UPDATE response_runs SET lease_until = ? WHERE id = ? AND lease_token = ?",
                              (lease_until, response_id, token)).rowcount:
                    held.add(response_id)
            return held

        return await self._txn(renew)

    async def claim_response_runs(self, token: str, now: float, lease_until: float, limit: int) -> list[ResponseRun]:
        def claim(db: sqlite3.Connection) -> list[ResponseRun]:
            found = db.execute("SELECT id, owner, request, attempts, (SELECT COALESCE(MAX(seq), -1) FROM "
                               "response_events e WHERE e.response_id = response_runs.id) FROM response_runs "
                               "WHERE lease_until < ? ORDER BY lease_until LIMIT ?", (now, limit)).fetchall()
            db.executemany("UPDATE response_runs SET lease_token = ?, lease_until = ?, attempts = attempts + 1 "
                           "WHERE id = ?", [(token, lease_until, row[0]) for row in found])
            return [ResponseRun(row[1], row[0], bytes(row[2]), int(row[3]) + 1, int(row[4])) for row in found]

        return await self._txn(claim)

    async def get_response(self, owner: str, response_id: str) -> StoredResponse | None:
        def get() -> StoredResponse | None:
            assert self._db is not None
            row = self._db.execute("SELECT body, input_items FROM responses WHERE id = ? AND owner = ?",
                                   (response_id, owner)).fetchone()
            return None if row is None else StoredResponse(bytes(row[0]), bytes(row[1]))

        return await self._call(get)

    async def delete_response(self, owner: str, response_id: str) -> bool:
        def delete(db: sqlite3.Connection) -> bool:
            if db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner)).rowcount == 0:
                return False
            db.execute("DELETE FROM response_runs WHERE id = ?", (response_id,))
            db.execute("DELETE FROM response_events WHERE response_id = ?", (response_id,))
            return True

        return await self._txn(delete)

    async def delete_responses_before(self, created_at: int) -> int:
        def delete(db: sqlite3.Connection) -> int:
            for statement in _FORGET_OLD_RUNS:
                db.execute(statement, (created_at,))
            return db.execute("DELETE FROM responses WHERE created_at < ?", (created_at,)).rowcount

        return await self._txn(delete)

    # -- conversations ---------------------------------------------------------------------------

    async def create_conversation(self, owner: str, conversation_id: str, created_at: int, metadata: bytes,
                                  items: Sequence[tuple[str, bytes]]) -> None:
        def create(db: sqlite3.Connection) -> None:
            db.execute(_CONVERSATIONS.insert, (conversation_id, owner, created_at, metadata))
            _append_items(db, conversation_id, items)

        await self._txn(create)

    async def get_conversation(self, owner: str, conversation_id: str,
                               with_items: bool = False) -> StoredConversation | None:
        def get() -> StoredConversation | None:
            assert self._db is not None
            row = self._db.execute(_CONVERSATIONS.get, (conversation_id, owner)).fetchone()
            if row is None:
                return None
            items = [bytes(r[0]) for r in self._db.execute(_CONVERSATIONS.items, (conversation_id,))] \
                if with_items else []
            return StoredConversation(int(row[0]), bytes(row[1]), tuple(items))

        return await self._call(get)

    async def update_conversation(self, owner: str, conversation_id: str, metadata: bytes) -> bool:
        def update(db: sqlite3.Connection) -> bool:
            return db.execute(_CONVERSATIONS.update, (metadata, conversation_id, owner)).rowcount > 0

        return await self._txn(update)

    async def delete_conversation(self, owner: str, conversation_id: str) -> bool:
        def delete(db: sqlite3.Connection) -> bool:
            if db.execute(_CONVERSATIONS.delete, (conversation_id, owner)).rowcount == 0:
                return False
            db.execute(_CONVERSATIONS.delete_items, (conversation_id,))
            return True

        return await self._txn(delete)

    async def add_conversation_items(self, owner: str, conversation_id: str,
                                     items: Sequence[tuple[str, bytes]]) -> bool:
        def add(db: sqlite3.Connection) -> bool:
            if db.execute(_CONVERSATIONS.get, (conversation_id, owner)).fetchone() is None:
                return False
            _append_items(db, conversation_id, items)
            return True

        return await self._txn(add)

    async def delete_conversation_item(self, owner: str, conversation_id: str, item_id: str) -> bool:
        def delete(db: sqlite3.Connection) -> bool:
            return db.execute(_CONVERSATIONS.delete_item,
                              (conversation_id, item_id, conversation_id, owner)).rowcount > 0

        return await self._txn(delete)

    async def list_files(self, owner: str, purpose: str | None, after: str | None, limit: int,
                         ascending: bool = False) -> list[FileObject]:
        def page(db: sqlite3.Connection) -> list[FileObject]:
            query, params = rows.files_page("?", owner, purpose, after, limit, ascending)
            return [rows.file_of(r) for r in db.execute(query, params)]

        return await self._call(page, self._db)

    # -- batches ---------------------------------------------------------------------------------

    async def create_batch(self, batch: NewBatch, idempotency_key: str | None = None) -> BatchJob:
        def create(db: sqlite3.Connection) -> BatchJob:
            batch_id = rows.new_batch_id()
            db.execute("INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, metadata, "
                       "created_at, expires_at, idempotency_key, output_expires_after_s, seq) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, (SELECT COALESCE(MAX(seq), 0) + 1 FROM batches)) "
                       "ON CONFLICT (owner, idempotency_key) DO NOTHING",
                       (batch_id, batch.owner, batch.endpoint, batch.input_file_id, batch.completion_window,
                        BatchStatus.VALIDATING.value, rows.dump_json(batch.metadata), batch.created_at,
                        batch.expires_at, idempotency_key, batch.output_expires_after_s))
            found = (_get_batch(db, None, batch_id) if idempotency_key is None
                     else _find_batch(db, batch.owner, idempotency_key))
            assert found is not None  # just inserted, or the key's earlier batch
            return found

        return await self._txn(create)

    async def get_batch(self, owner: str | None, batch_id: str) -> BatchJob | None:
        return await self._call(_get_batch, self._db, owner, batch_id)

    async def find_batch(self, owner: str, idempotency_key: str) -> BatchJob | None:
        return await self._call(_find_batch, self._db, owner, idempotency_key)

    async def list_batches(self, owner: str, after: str | None, limit: int) -> list[BatchJob]:
        def page(db: sqlite3.Connection) -> list[BatchJob]:
            query = f"SELECT {rows.BATCH_COLUMNS} FROM batches WHERE owner = ?"
            params: list[Any] = [owner]
            if after is not None:
                query += " AND seq < (SELECT seq FROM batches WHERE id = ? AND owner = ?)"
                params += [after, owner]
            query += " ORDER BY seq DESC LIMIT ?"
            return [rows.batch_of(r) for r in db.execute(query, (*params, limit))]

        return await self._call(page, self._db)

    async def active_batches(self) -> list[BatchJob]:
        def active(db: sqlite3.Connection) -> list[BatchJob]:
            return [rows.batch_of(r) for r in db.execute(
                f"SELECT {rows.BATCH_COLUMNS} FROM batches WHERE status IN (?, ?, ?, ?) ORDER BY seq",
                [s.value for s in rows.ACTIVE])]

        return await self._call(active, self._db)

    async def start_batch(self, batch_id: str, items: Sequence[NewItem], now: int,
                          num_total: int | None = None) -> bool:
        def start(db: sqlite3.Connection) -> bool:
            updated = db.execute("UPDATE batches SET status = ?, in_progress_at = ?, num_total = ? "
                                 "WHERE id = ? AND status = ?",
                                 (BatchStatus.IN_PROGRESS.value, now, len(items) if num_total is None else num_total,
                                  batch_id, BatchStatus.VALIDATING.value)).rowcount
            if updated:
                _insert_items(db, batch_id, items)
            return updated > 0

        return await self._txn(start)

    async def add_items(self, batch_id: str, items: Sequence[NewItem]) -> None:
        await self._txn(_insert_items, batch_id, items)

    async def num_items(self, batch_id: str) -> int:
        def count(db: sqlite3.Connection) -> int:
            return int(db.execute("SELECT COUNT(*) FROM items WHERE batch_id = ?", (batch_id,)).fetchone()[0])

        return await self._call(count, self._db)

    async def fail_batch(self, batch_id: str, errors: list[dict[str, object]], now: int) -> None:
        def fail(db: sqlite3.Connection) -> None:
            db.execute("UPDATE batches SET status = ?, failed_at = ?, errors = ? WHERE id = ? AND status = ?",
                       (BatchStatus.FAILED.value, now, rows.dump_json(errors), batch_id,
                        BatchStatus.VALIDATING.value))

        await self._txn(fail)

    async def cancel_batch(self, owner: str, batch_id: str, now: int) -> BatchJob | None:
        def cancel(db: sqlite3.Connection) -> BatchJob | None:
            db.execute("UPDATE batches SET status = ?, cancelling_at = ? WHERE id = ? AND owner = ? "
                       "AND status IN (?, ?)", (BatchStatus.CANCELLING.value, now, batch_id, owner,
                                                BatchStatus.VALIDATING.value, BatchStatus.IN_PROGRESS.value))
            return _get_batch(db, owner, batch_id)

        return await self._txn(cancel)

    # -- items -----------------------------------------------------------------------------------

    async def claim(self, limit: int, lease_s: float, now: float,
                    room: Mapping[str, int] | None = None) -> Claim | None:
        def claim(db: sqlite3.Connection) -> Claim | None:
            token, until = rows.new_token(), now + lease_s
            claimed: list[Item] = []
            batches = db.execute("SELECT id, owner FROM batches WHERE status = ? AND expires_at > ? ORDER BY seq",
                                 (BatchStatus.IN_PROGRESS.value, now)).fetchall()
            left = dict(room or {})
            for batch_id, owner in batches:
                for query in (_CLAIMABLE_EXPIRED, _CLAIMABLE_QUEUED):
                    want = min(limit - len(claimed), left.get(owner, limit))
                    if want > 0:
                        found = db.execute(query, (batch_id, now, want)).fetchall()
                        claimed += [Item(batch_id, r[0], r[1], r[2], bytes(r[3]), r[4]) for r in found]
                        if owner in left:
                            left[owner] -= len(found)
            if not claimed:
                return None
            db.executemany("UPDATE items SET state = 'leased', lease_token = ?, lease_until = ? "
                           "WHERE batch_id = ? AND idx = ?", ((token, until, i.batch_id, i.idx) for i in claimed))
            return Claim(token, until, tuple(claimed))

        return await self._txn(claim)

    async def extend_lease(self, token: str, until: float) -> None:
        def extend(db: sqlite3.Connection) -> None:
            db.execute("UPDATE items SET lease_until = ? WHERE lease_token = ? AND state = 'leased'", (until, token))

        await self._txn(extend)

    async def record(self, token: str, outcomes: Sequence[ItemOutcome]) -> int:
        return await self._txn(_record, token, outcomes)

    async def release_leases(self) -> int:
        def release(db: sqlite3.Connection) -> int:
            db.execute("UPDATE response_runs SET lease_until = 0")
            return db.execute("UPDATE items SET state = 'queued', lease_token = NULL WHERE state = 'leased'").rowcount

        return await self._txn(release)

    async def num_live_leases(self, batch_id: str, now: float) -> int:
        def count(db: sqlite3.Connection) -> int:
            return int(db.execute("SELECT COUNT(*) FROM items WHERE batch_id = ? AND state = 'leased' "
                                  "AND lease_until >= ?", (batch_id, now)).fetchone()[0])

        return await self._call(count, self._db)

    async def begin_finalizing(self, batch_id: str, now: int) -> BatchJob | None:
        def begin(db: sqlite3.Connection) -> BatchJob | None:
            db.execute(_BEGIN_FINALIZING, (BatchStatus.FINALIZING.value, now, batch_id,
                                           BatchStatus.IN_PROGRESS.value))
            batch = _get_batch(db, None, batch_id)
            return batch if batch is not None and batch.status is BatchStatus.FINALIZING else None

        return await self._txn(begin)

    async def finalize(self, batch_id: str, status: BatchStatus, leftover: LeftoverLine | None,
                       now: int) -> BatchJob | None:
        return await self._txn(_finalize, batch_id, status, leftover, now)

    async def result_lines(self, batch_id: str, after_idx: int, limit: int) -> list[ResultLine]:
        def page(db: sqlite3.Connection) -> list[ResultLine]:
            before = after_idx + limit + 1
            for state in ("queued", "leased"):  # the first item without a line ends the page
                row = db.execute(_FIRST_IN_STATE, (batch_id, state, after_idx)).fetchone()
                if row is not None:
                    before = min(before, row[0])
            found = db.execute("SELECT idx, line, is_error FROM items WHERE batch_id = ? AND idx > ? AND idx < ? "
                               "ORDER BY idx", (batch_id, after_idx, before))
            return [ResultLine(r[0], bytes(r[1]), bool(r[2])) for r in found]

        return await self._call(page, self._db)


def _add_columns(db: sqlite3.Connection) -> None:
    """Bring a database made by an older sluice up to date: the columns added since (SQLite has no
    `ADD COLUMN IF NOT EXISTS`: each table's columns are looked up first)."""
    for table, column, kind in rows.ADDED_COLUMNS:
        if column not in {row[1] for row in db.execute(f"PRAGMA table_info({table})")}:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind.format(int='INTEGER')}")
    db.execute(rows.AFTER_ADDED_COLUMNS)


def _get_batch(db: sqlite3.Connection, owner: str | None, batch_id: str) -> BatchJob | None:
    if owner is None:
        row = db.execute(f"SELECT {rows.BATCH_COLUMNS} FROM batches WHERE id = ?", (batch_id,)).fetchone()
    else:
        row = db.execute(f"SELECT {rows.BATCH_COLUMNS} FROM batches WHERE id = ? AND owner = ?",
                         (batch_id, owner)).fetchone()
    return rows.batch_of(row) if row else None


def _find_batch(db: sqlite3.Connection, owner: str, idempotency_key: str) -> BatchJob | None:
    row = db.execute(f"SELECT {rows.BATCH_COLUMNS} FROM batches WHERE owner = ? AND idempotency_key = ?",
                     (owner, idempotency_key)).fetchone()
    return rows.batch_of(row) if row else None


def _insert_items(db: sqlite3.Connection, batch_id: str, items: Sequence[NewItem]) -> None:
    db.executemany("INSERT INTO items (batch_id, idx, custom_id, url, body) VALUES (?, ?, ?, ?, ?) "
                   "ON CONFLICT (batch_id, idx) DO NOTHING",
                   ((batch_id, i.idx, i.custom_id, i.url, i.body) for i in items))


def _record(db: sqlite3.Connection, token: str, outcomes: Sequence[ItemOutcome]) -> int:
    totals: dict[str, list[int]] = {}
    applied = 0
    for o in outcomes:
        if o.retry_at is not None:
            count = db.execute("UPDATE items SET state = 'queued', lease_token = NULL, not_before = ?, attempts = ? "
                               "WHERE batch_id = ? AND idx = ? AND lease_token = ? AND state = 'leased'",
                               (o.retry_at, o.attempts, o.batch_id, o.idx, token)).rowcount
            applied += count
            continue
        count = db.execute("UPDATE items SET state = 'done', line = ?, is_error = ?, attempts = ? "
                           "WHERE batch_id = ? AND idx = ? AND lease_token = ? AND state = 'leased'",
                           (o.line, int(o.is_error), o.attempts, o.batch_id, o.idx, token)).rowcount
        if count:
            applied += 1
            sums = totals.setdefault(o.batch_id, [0, 0, 0, 0, 0, 0])
            sums[1 if o.is_error else 0] += 1
            sums[2] += o.input_tokens
            sums[3] += o.output_tokens
            sums[4] += o.cached_tokens
            sums[5] += o.reasoning_tokens
    db.executemany("UPDATE batches SET num_completed = num_completed + ?, num_failed = num_failed + ?, "
                   "input_tokens = input_tokens + ?, output_tokens = output_tokens + ?, "
                   "cached_tokens = cached_tokens + ?, reasoning_tokens = reasoning_tokens + ? WHERE id = ?",
                   ((*sums, batch_id) for batch_id, sums in totals.items()))
    return applied


def _finalize(db: sqlite3.Connection, batch_id: str, status: BatchStatus, leftover: LeftoverLine | None,
              now: int) -> BatchJob | None:
    batch = _get_batch(db, None, batch_id)
    if batch is None or not batch.is_active:
        return batch
    left = db.execute("SELECT idx, custom_id FROM items WHERE batch_id = ? AND state != 'done'",
                      (batch_id,)).fetchall()
    if left and leftover is None:
        return None
    db.executemany("UPDATE items SET state = 'done', is_error = 1, line = ?, lease_token = NULL "
                   "WHERE batch_id = ? AND idx = ?", ((leftover(c), batch_id, i) for i, c in left) if leftover else ())
    file_ids = _write_files(db, batch_id, batch.owner, now, rows.output_expires_at(batch, now))
    stamp = rows.FINAL_STAMP[status]
    db.execute(f"UPDATE batches SET status = ?, finalizing_at = COALESCE(finalizing_at, ?), {stamp} = ?, "
               "output_file_id = ?, error_file_id = ? WHERE id = ?", (status.value, now, now, *file_ids, batch_id))
    return _get_batch(db, None, batch_id)


def _write_files(db: sqlite3.Connection, batch_id: str, owner: str, now: int,
                 expires_at: int | None) -> list[str | None]:
    """The output and error files from the items' lines in input order, written in parts as the
    lines are read (never the whole file in memory); their ids, None for a file with no line."""
    writers = (rows.PartWriter("output"), rows.PartWriter("errors"))

    def write(writer: rows.PartWriter, part: bytes | None) -> None:
        if part is not None:
            db.execute("INSERT INTO file_parts (file_id, part, data) VALUES (?, ?, ?)",
                       (writer.file_id, writer.num_parts, part))

    for line, is_error in db.execute("SELECT line, is_error FROM items WHERE batch_id = ? ORDER BY idx",
                                     (batch_id,)):
        writer = writers[1 if is_error else 0]
        write(writer, writer.add(bytes(line)))
    for writer in writers:
        write(writer, writer.take())
        if writer.num_bytes:
            db.execute("INSERT INTO files (id, owner, filename, purpose, bytes, created_at, content, expires_at) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (writer.file_id, owner, f"{batch_id}_{writer.suffix}.jsonl",
                                                           "batch_output", writer.num_bytes, now, b"", expires_at))
    return [writer.file_id if writer.num_bytes else None for writer in writers]


def _append_items(db: sqlite3.Connection, conversation_id: str, items: Sequence[tuple[str, bytes]]) -> None:
    """After the conversation's last item (the one writer's transaction orders appends)."""
    (first,) = db.execute(_CONVERSATIONS.next_seq, (conversation_id,)).fetchone()
    db.executemany(_CONVERSATIONS.add_item, [(conversation_id, first + i, item_id, data)
                                             for i, (item_id, data) in enumerate(items)])

"""The shared job store: PostgreSQL through psycopg 3's async connection pool.

Same tables and semantics as `SqliteJobStore`, for servers on several hosts sharing one job
queue. Claims lock candidate rows `FOR UPDATE SKIP LOCKED`, so concurrent executors never wait
on each other and never lease the same item; a lease that expires (its holder died) makes the
item claimable again. `release_leases` is a no-op here: other hosts may hold live leases.

The database restarting (or failing over) is survived, not waited out:
- a call that cannot reach it raises `Unavailable` (a 503 with a Retry-After to API clients)
  once no connection came within `wait_s`, instead of hanging in the pool's queue (30 s) and
  then failing with a foreign error;
- a pooled connection broken by the restart is checked and replaced when it is taken, so the
  first calls after it do not fail;
- the pool gives a connection attempt up after `reconnect_s` and starts a fresh one, so it tries
  about once a second and connects within about a second of the database coming back: left to
  itself, psycopg_pool's retries back off exponentially (1, 2, 4 ... 64 s), which after an
  outage of a minute left the jobs stalled for up to another minute;
- while the database is known to be out of reach, calls wait only `UNREACHABLE_WAIT_S` for it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from sluice.errors import ConfigError, Unavailable
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

_BATCH_BY_ID = f"SELECT {rows.BATCH_COLUMNS} FROM batches WHERE id = %s"
_BATCH_BY_KEY = f"SELECT {rows.BATCH_COLUMNS} FROM batches WHERE owner = %s AND idempotency_key = %s"
_CLAIM = ("SELECT idx, custom_id, url, body, attempts FROM items WHERE batch_id = %s AND {cond} "
          "ORDER BY idx LIMIT %s FOR UPDATE SKIP LOCKED")
_FIRST_IN_STATE = "SELECT idx FROM items WHERE batch_id = %s AND state = %s AND idx > %s ORDER BY idx LIMIT 1"
_CLAIM_CONDITIONS = ("state = 'leased' AND lease_until < %s", "state = 'queued' AND not_before <= %s")
_CONVERSATIONS = rows.ConversationSql("%s")
_PUT_RESPONSE = "INSERT INTO responses (id, owner, created_at, body, input_items) VALUES (%s, %s, %s, %s, %s)"
_RESPONSE_EVENTS = ("SELECT e.seq, e.data FROM response_events e JOIN responses r ON r.id = e.response_id "
                    "WHERE e.response_id = %s AND r.owner = %s AND e.seq > %s ORDER BY e.seq LIMIT %s")
_DELETE_EXPIRED_FILES = ("WITH gone AS (DELETE FROM files WHERE expires_at <= %s RETURNING id), "
                         "parts AS (DELETE FROM file_parts p USING gone WHERE p.file_id = gone.id) "
                         "SELECT COUNT(*) FROM gone")
"""The files whose `expires_at` has come and their parts, in one statement: one snapshot, so a file
committed meanwhile is either gone with its parts or left whole (two statements in READ COMMITTED
could see it in the second only, and leave its parts behind); the count is the files'."""
_DELETE_OLD_RESPONSES = ("WITH gone AS (DELETE FROM responses WHERE created_at < %s RETURNING id), "
                         "runs AS (DELETE FROM response_runs r USING gone WHERE r.id = gone.id), "
                         "events AS (DELETE FROM response_events e USING gone WHERE e.response_id = gone.id) "
                         "SELECT COUNT(*) FROM gone")
"""Background responses past their retention, with their runs and streamed events, in one statement."""

log = logging.getLogger("sluice.jobs")

RETRY_AFTER_S = 2.0
"""What a client is told to wait when the database cannot be reached."""
UNREACHABLE_WAIT_S = 1.0
"""How long a call waits for a connection while the database is known to be out of reach."""


class PostgresJobStore:
    def __init__(self, pool: AsyncConnectionPool[AsyncConnection[Any]]) -> None:
        self._pool = pool
        self._is_reachable = True
        """Whether the last call reached the database (its losses and returns are logged once)."""

    @classmethod
    async def connect(cls, dsn: str, max_size: int = 8, wait_s: float = 5.0, reconnect_s: float = 2.0,
                      open_timeout_s: float = 30.0) -> PostgresJobStore:
        """A store on the database at `dsn`, its schema created or brought up to date, once it can
        be reached (tried about once a second for up to `open_timeout_s`: a database started beside
        the server may come up a little after it). Calls wait up to `wait_s` for a connection; a
        connection attempt is retried for `reconnect_s`."""
        pool: AsyncConnectionPool[AsyncConnection[Any]] = AsyncConnectionPool(
            dsn, min_size=1, max_size=max_size, open=False, timeout=wait_s, reconnect_timeout=reconnect_s,
            reconnect_failed=_reconnect_again, check=AsyncConnectionPool.check_connection)
        try:
            await pool.open(wait=True, timeout=open_timeout_s)
            async with pool.connection() as conn:  # one transaction: a failed migration changes nothing
                await conn.execute("SELECT pg_advisory_xact_lock(7312001)")  # one schema migration at a time
                for statement in rows.SCHEMA.format(blob="BYTEA", real="DOUBLE PRECISION", int="BIGINT").split(";"):
                    if statement.strip():
                        await conn.execute(statement)
                for table, column, kind in rows.ADDED_COLUMNS:  # a database made by an older sluice
                    await conn.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} "
                                       f"{kind.format(int='BIGINT')}")
                await conn.execute(rows.AFTER_ADDED_COLUMNS)
                await _number_batches(conn)
        except PoolTimeout as exc:  # says only that the pool is not full: ask the database why
            await pool.close()
            raise ConfigError(f"cannot use the PostgreSQL job store: not reachable within {open_timeout_s:g} s: "
                              f"{await _why_unreachable(dsn)}") from exc
        except Exception as exc:
            await pool.close()
            raise ConfigError(f"cannot use the PostgreSQL job store: {exc}") from exc
        return cls(pool)

    async def aclose(self) -> None:
        await self._pool.close()

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[AsyncConnection[Any]]:
        """A pooled connection; the database out of reach (down, restarting, no connection free
        within `wait_s`) is `Unavailable`, whether found on taking the connection or while using it."""
        try:
            async with self._pool.connection(timeout=None if self._is_reachable else UNREACHABLE_WAIT_S) as conn:
                yield conn
        except psycopg.OperationalError as exc:
            if self._is_reachable:
                self._is_reachable = False
                log.warning("the job store's database cannot be reached (%s: %s); batch jobs wait for it and "
                            "the Files and Batch APIs answer 503", type(exc).__name__,
                            (str(exc).strip().splitlines() or [""])[0])
            raise Unavailable("the batch job store is unavailable; try again shortly",
                              retry_after_s=RETRY_AFTER_S) from exc
        if not self._is_reachable:
            self._is_reachable = True
            log.warning("the job store's database is reachable again")

    async def _one(self, query: str, params: Sequence[Any]) -> Any:
        async with self._connection() as conn:
            return await (await conn.execute(query, params)).fetchone()

    # -- files -----------------------------------------------------------------------------------

    async def create_file(self, owner: str, filename: str, purpose: str, content: bytes, now: int,
                          idempotency_key: str | None = None, file_id: str | None = None,
                          expires_at: int | None = None) -> FileObject:
        file_id = file_id or rows.new_file_id()
        async with self._connection() as conn:
            await conn.execute(
                "INSERT INTO files (id, owner, filename, purpose, bytes, created_at, content, idempotency_key, "
                "expires_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (owner, idempotency_key) "
                "DO NOTHING", (file_id, owner, filename, purpose, len(content), now, content, idempotency_key,
                               expires_at))
            if idempotency_key is None:
                cur = await conn.execute(f"SELECT {rows.FILE_COLUMNS} FROM files WHERE id = %s", (file_id,))
            else:
                cur = await conn.execute(f"SELECT {rows.FILE_COLUMNS} FROM files WHERE owner = %s "
                                         "AND idempotency_key = %s", (owner, idempotency_key))
            return rows.file_of(await cur.fetchone())  # type: ignore[arg-type]

    async def get_file(self, owner: str, file_id: str) -> FileObject | None:
        row = await self._one(f"SELECT {rows.FILE_COLUMNS} FROM files WHERE id = %s AND owner = %s", (file_id, owner))
        return rows.file_of(row) if row else None

    async def file_content(self, owner: str, file_id: str) -> bytes | None:
        async with self._connection() as conn:
            row = await (await conn.execute("SELECT content FROM files WHERE id = %s AND owner = %s",
                                            (file_id, owner))).fetchone()
            if row is None:
                return None
            parts = await (await conn.execute("SELECT data FROM file_parts WHERE file_id = %s ORDER BY part",
                                              (file_id,))).fetchall()
            return b"".join([bytes(row[0]), *(bytes(p[0]) for p in parts)])

    async def file_part(self, owner: str, file_id: str, part: int) -> bytes | None:
        if part == 0:
            row = await self._one("SELECT content FROM files WHERE id = %s AND owner = %s", (file_id, owner))
        else:
            row = await self._one("SELECT p.data FROM file_parts p JOIN files f ON f.id = p.file_id "
                                  "WHERE p.file_id = %s AND f.owner = %s AND p.part = %s", (file_id, owner, part))
        return bytes(row[0]) if row else None

    async def delete_file(self, owner: str, file_id: str) -> bool:
        async with self._connection() as conn, conn.transaction():
            cur = await conn.execute("DELETE FROM files WHERE id = %s AND owner = %s", (file_id, owner))
            if cur.rowcount == 0:
                return False
            await conn.execute("DELETE FROM file_parts WHERE file_id = %s", (file_id,))
            return True

    async def delete_expired_files(self, now: int) -> int:
        return int((await self._one(_DELETE_EXPIRED_FILES, (now,)))[0])

    # -- stored responses ------------------------------------------------------------------------

    async def put_response(self, owner: str, response_id: str, created_at: int, body: bytes,
                           input_items: bytes) -> None:
        async with self._connection() as conn:
            await conn.execute(_PUT_RESPONSE, (response_id, owner, created_at, body, input_items))

    async def put_response_run(self, owner: str, response_id: str, created_at: int, body: bytes, input_items: bytes,
                               request: bytes, token: str, lease_until: float, events: Sequence[Event] = ()) -> None:
        async with self._connection() as conn, conn.transaction():
            await conn.execute(_PUT_RESPONSE, (response_id, owner, created_at, body, input_items))
            await conn.execute("INSERT INTO response_runs (id, owner, request, attempts, lease_token, lease_until) "
                               "VALUES (%s, %s, %s, %s, %s, %s)",
                               (response_id, owner, request, 1 if token else 0, token, lease_until))
            await _put_events(conn, response_id, events)

    async def update_response_run(self, response_id: str, token: str, body: bytes | None, *, is_final: bool,
                                  events: Sequence[Event] = ()) -> bool:
        async with self._connection() as conn, conn.transaction():
            held = await (await conn.execute("SELECT 1 FROM response_runs WHERE id = %s AND lease_token = %s "
                                             "FOR UPDATE", (response_id, token))).fetchone()
            if held is None:
                return False
            await _put_events(conn, response_id, events)
            if body is not None:
                await conn.execute("UPDATE responses SET body = %s WHERE id = %s", (body, response_id))
            if is_final:
                await conn.execute("DELETE FROM response_runs WHERE id = %s", (response_id,))
            return True

    async def num_response_runs(self, owner: str) -> int:
        row = await self._one("SELECT COUNT(*) FROM response_runs WHERE owner = %s", (owner,))
        return int(row[0])

    async def response_events(self, owner: str, response_id: str, after: int, limit: int) -> list[Event]:
        async with self._connection() as conn:
            cur = await conn.execute(_RESPONSE_EVENTS, (response_id, owner, after, limit))
            return [(int(row[0]), bytes(row[1])) for row in await cur.fetchall()]

    async def cancel_response_run(self, owner: str, response_id: str, body: bytes) -> bool:
        async with self._connection() as conn, conn.transaction():
            cur = await conn.execute("DELETE FROM response_runs WHERE id = %s AND owner = %s", (response_id, owner))
            if cur.rowcount == 0:
                return False
            await conn.execute("UPDATE responses SET body = %s WHERE id = %s", (body, response_id))
            return True

    async def renew_response_runs(self, token: str, response_ids: Sequence[str], lease_until: float) -> set[str]:
        async with self._connection() as conn:
            cur = await conn.execute("UPDATE response_runs SET lease_until = %s WHERE lease_token = %s "
                                     "AND id = ANY(%s) RETURNING id", (lease_until, token, list(response_ids)))
            return {row[0] for row in await cur.fetchall()}

    async def claim_response_runs(self, token: str, now: float, lease_until: float, limit: int) -> list[ResponseRun]:
        async with self._connection() as conn:
            cur = await conn.execute(
                "UPDATE response_runs SET lease_token = %s, lease_until = %s, attempts = attempts + 1 WHERE id IN "
                "(SELECT id FROM response_runs WHERE lease_until < %s ORDER BY lease_until LIMIT %s "
                "FOR UPDATE SKIP LOCKED) RETURNING id, owner, request, attempts, (SELECT COALESCE(MAX(e.seq), -1) "
                "FROM response_events e WHERE e.response_id = response_runs.id)", (token, lease_until, now, limit))
            found = await cur.fetchall()
            return [ResponseRun(row[1], row[0], bytes(row[2]), int(row[3]), int(row[4])) for row in found]

    async def get_response(self, owner: str, response_id: str) -> StoredResponse | None:
        row = await self._one("SELECT body, input_items FROM responses WHERE id = %s AND owner = %s",
                              (response_id, owner))
        return None if row is None else StoredResponse(bytes(row[0]), bytes(row[1]))

    async def delete_response(self, owner: str, response_id: str) -> bool:
        async with self._connection() as conn, conn.transaction():
            cur = await conn.execute("DELETE FROM responses WHERE id = %s AND owner = %s", (response_id, owner))
            if cur.rowcount == 0:
                return False
            await conn.execute("DELETE FROM response_runs WHERE id = %s", (response_id,))
            await conn.execute("DELETE FROM response_events WHERE response_id = %s", (response_id,))
            return True

    async def delete_responses_before(self, created_at: int) -> int:
        return int((await self._one(_DELETE_OLD_RESPONSES, (created_at,)))[0])

    # -- conversations ---------------------------------------------------------------------------

    async def create_conversation(self, owner: str, conversation_id: str, created_at: int, metadata: bytes,
                                  items: Sequence[tuple[str, bytes]]) -> None:
        async with self._connection() as conn, conn.transaction():
            await conn.execute(_CONVERSATIONS.insert, (conversation_id, owner, created_at, metadata))
            await _append_items(conn, conversation_id, items)

    async def get_conversation(self, owner: str, conversation_id: str,
                               with_items: bool = False) -> StoredConversation | None:
        async with self._connection() as conn, conn.transaction():  # the items as of the row read
            row = await (await conn.execute(_CONVERSATIONS.get, (conversation_id, owner))).fetchone()
            if row is None:
                return None
            items = await (await conn.execute(_CONVERSATIONS.items, (conversation_id,))).fetchall() \
                if with_items else []
        return StoredConversation(int(row[0]), bytes(row[1]), tuple(bytes(r[0]) for r in items))

    async def update_conversation(self, owner: str, conversation_id: str, metadata: bytes) -> bool:
        async with self._connection() as conn:
            return (await conn.execute(_CONVERSATIONS.update, (metadata, conversation_id, owner))).rowcount > 0

    async def delete_conversation(self, owner: str, conversation_id: str) -> bool:
        async with self._connection() as conn, conn.transaction():
            if (await conn.execute(_CONVERSATIONS.delete, (conversation_id, owner))).rowcount == 0:
                return False
            await conn.execute(_CONVERSATIONS.delete_items, (conversation_id,))
            return True

    async def add_conversation_items(self, owner: str, conversation_id: str,
                                     items: Sequence[tuple[str, bytes]]) -> bool:
        async with self._connection() as conn, conn.transaction():
            # the conversation's row locked: appends by other gateways wait, and number after these
            found = await conn.execute(_CONVERSATIONS.get + " FOR UPDATE", (conversation_id, owner))
            if await found.fetchone() is None:
                return False
            await _append_items(conn, conversation_id, items)
            return True

    async def delete_conversation_item(self, owner: str, conversation_id: str, item_id: str) -> bool:
        async with self._connection() as conn:
            cur = await conn.execute(_CONVERSATIONS.delete_item, (conversation_id, item_id, conversation_id, owner))
            return cur.rowcount > 0

    async def list_files(self, owner: str, purpose: str | None, after: str | None, limit: int,
                         ascending: bool = False) -> list[FileObject]:
        query, params = rows.files_page("%s", owner, purpose, after, limit, ascending)
        async with self._connection() as conn:
            cur = await conn.execute(query, params)
            return [rows.file_of(r) for r in await cur.fetchall()]

    # -- batches ---------------------------------------------------------------------------------

    async def create_batch(self, batch: NewBatch, idempotency_key: str | None = None) -> BatchJob:
        batch_id = rows.new_batch_id()
        async with self._connection() as conn:
            await conn.execute(  # seq: the identity column's next value
                "INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, metadata, "
                "created_at, expires_at, idempotency_key, output_expires_after_s) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (owner, idempotency_key) DO NOTHING",
                (batch_id, batch.owner, batch.endpoint, batch.input_file_id, batch.completion_window,
                 BatchStatus.VALIDATING.value, rows.dump_json(batch.metadata), batch.created_at, batch.expires_at,
                 idempotency_key, batch.output_expires_after_s))
            if idempotency_key is None:
                cur = await conn.execute(_BATCH_BY_ID, (batch_id,))
            else:
                cur = await conn.execute(_BATCH_BY_KEY, (batch.owner, idempotency_key))
            return rows.batch_of(await cur.fetchone())  # type: ignore[arg-type]

    async def get_batch(self, owner: str | None, batch_id: str) -> BatchJob | None:
        if owner is None:
            row = await self._one(_BATCH_BY_ID, (batch_id,))
        else:
            row = await self._one(_BATCH_BY_ID + " AND owner = %s", (batch_id, owner))
        return rows.batch_of(row) if row else None

    async def find_batch(self, owner: str, idempotency_key: str) -> BatchJob | None:
        row = await self._one(_BATCH_BY_KEY, (owner, idempotency_key))
        return rows.batch_of(row) if row else None

    async def list_batches(self, owner: str, after: str | None, limit: int) -> list[BatchJob]:
        query = f"SELECT {rows.BATCH_COLUMNS} FROM batches WHERE owner = %s"
        params: list[Any] = [owner]
        if after is not None:
            query += " AND seq < (SELECT seq FROM batches WHERE id = %s AND owner = %s)"
            params += [after, owner]
        async with self._connection() as conn:
            cur = await conn.execute(query + " ORDER BY seq DESC LIMIT %s", (*params, limit))
            return [rows.batch_of(r) for r in await cur.fetchall()]

    async def active_batches(self) -> list[BatchJob]:
        async with self._connection() as conn:
            cur = await conn.execute(f"SELECT {rows.BATCH_COLUMNS} FROM batches WHERE status = ANY(%s) ORDER BY seq",
                                     ([s.value for s in rows.ACTIVE],))
            return [rows.batch_of(r) for r in await cur.fetchall()]

    async def start_batch(self, batch_id: str, items: Sequence[NewItem], now: int,
                          num_total: int | None = None) -> bool:
        async with self._connection() as conn, conn.transaction():
            cur = await conn.execute("UPDATE batches SET status = %s, in_progress_at = %s, num_total = %s "
                                     "WHERE id = %s AND status = %s",
                                     (BatchStatus.IN_PROGRESS.value, now,
                                      len(items) if num_total is None else num_total, batch_id,
                                      BatchStatus.VALIDATING.value))
            if cur.rowcount == 0:
                return False
            async with conn.cursor().copy("COPY items (batch_id, idx, custom_id, url, body) FROM STDIN") as copy:
                for i in items:
                    await copy.write_row((batch_id, i.idx, i.custom_id, i.url, i.body))
            return True

    async def add_items(self, batch_id: str, items: Sequence[NewItem]) -> None:
        """Plain inserts rather than COPY: another gateway resuming the same load may race us."""
        async with self._connection() as conn, conn.transaction():
            await conn.cursor().executemany(
                "INSERT INTO items (batch_id, idx, custom_id, url, body) VALUES (%s, %s, %s, %s, %s) "
                "ON CONFLICT (batch_id, idx) DO NOTHING",
                [(batch_id, i.idx, i.custom_id, i.url, i.body) for i in items])

    async def num_items(self, batch_id: str) -> int:
        row = await self._one("SELECT COUNT(*) FROM items WHERE batch_id = %s", (batch_id,))
        return int(row[0])

    async def fail_batch(self, batch_id: str, errors: list[dict[str, object]], now: int) -> None:
        async with self._connection() as conn:
            await conn.execute("UPDATE batches SET status = %s, failed_at = %s, errors = %s WHERE id = %s "
                               "AND status = %s", (BatchStatus.FAILED.value, now, rows.dump_json(errors), batch_id,
                                                   BatchStatus.VALIDATING.value))

    async def cancel_batch(self, owner: str, batch_id: str, now: int) -> BatchJob | None:
        """The batch as the update left it: a cancel that won is answered `cancelling` even if the
        executor finishes the batch at once."""
        async with self._connection() as conn:
            cur = await conn.execute(f"UPDATE batches SET status = %s, cancelling_at = %s WHERE id = %s AND owner = %s "
                                     f"AND status IN (%s, %s) RETURNING {rows.BATCH_COLUMNS}",
                                     (BatchStatus.CANCELLING.value, now, batch_id, owner,
                                      BatchStatus.VALIDATING.value, BatchStatus.IN_PROGRESS.value))
            row = await cur.fetchone()
        return rows.batch_of(row) if row else await self.get_batch(owner, batch_id)

    # -- items -----------------------------------------------------------------------------------

    async def claim(self, limit: int, lease_s: float, now: float,
                    room: Mapping[str, int] | None = None) -> Claim | None:
        token, until = rows.new_token(), now + lease_s
        claimed: list[Item] = []
        left = dict(room or {})
        async with self._connection() as conn, conn.transaction():
            cur = await conn.execute("SELECT id, owner FROM batches WHERE status = %s AND expires_at > %s ORDER BY seq",
                                     (BatchStatus.IN_PROGRESS.value, now))
            for batch_id, owner in await cur.fetchall():
                for cond in _CLAIM_CONDITIONS:
                    want = min(limit - len(claimed), left.get(owner, limit))
                    if want > 0:
                        found = await (await conn.execute(_CLAIM.format(cond=cond), (batch_id, now, want))).fetchall()
                        claimed += [Item(batch_id, r[0], r[1], r[2], bytes(r[3]), r[4]) for r in found]
                        if owner in left:
                            left[owner] -= len(found)
            if not claimed:
                return None
            await conn.cursor().executemany(
                "UPDATE items SET state = 'leased', lease_token = %s, lease_until = %s "
                "WHERE batch_id = %s AND idx = %s",
                [(token, until, i.batch_id, i.idx) for i in claimed])
        return Claim(token, until, tuple(claimed))

    async def extend_lease(self, token: str, until: float) -> None:
        async with self._connection() as conn:
            await conn.execute("UPDATE items SET lease_until = %s WHERE lease_token = %s AND state = 'leased'",
                               (until, token))

    async def record(self, token: str, outcomes: Sequence[ItemOutcome]) -> int:
        retries = [o for o in outcomes if o.retry_at is not None]
        finals = {(o.batch_id, o.idx): o for o in outcomes if o.retry_at is None}
        async with self._connection() as conn, conn.transaction():
            cur = conn.cursor()
            applied = 0
            if retries:
                await cur.executemany(
                    "UPDATE items SET state = 'queued', lease_token = NULL, not_before = %s, attempts = %s "
                    "WHERE batch_id = %s AND idx = %s AND lease_token = %s AND state = 'leased' RETURNING idx",
                    [(o.retry_at, o.attempts, o.batch_id, o.idx, token) for o in retries], returning=True)
                applied += _num_returned(cur)
            if not finals:
                return applied
            await cur.executemany(
                "UPDATE items SET state = 'done', line = %s, is_error = %s, attempts = %s WHERE batch_id = %s "
                "AND idx = %s AND lease_token = %s AND state = 'leased' RETURNING batch_id, idx",
                [(o.line, int(o.is_error), o.attempts, o.batch_id, o.idx, token) for o in finals.values()],
                returning=True)
            totals: dict[str, list[int]] = {}
            while True:
                for batch_id, idx in await cur.fetchall():
                    o = finals[(batch_id, idx)]
                    sums = totals.setdefault(batch_id, [0, 0, 0, 0, 0, 0])
                    sums[1 if o.is_error else 0] += 1
                    sums[2] += o.input_tokens
                    sums[3] += o.output_tokens
                    sums[4] += o.cached_tokens
                    sums[5] += o.reasoning_tokens
                    applied += 1
                if not cur.nextset():
                    break
            await cur.executemany(
                "UPDATE batches SET num_completed = num_completed + %s, num_failed = num_failed + %s, "
                "input_tokens = input_tokens + %s, output_tokens = output_tokens + %s, "
                "cached_tokens = cached_tokens + %s, reasoning_tokens = reasoning_tokens + %s WHERE id = %s",
                [(*sums, batch_id) for batch_id, sums in totals.items()])
        return applied

    async def release_leases(self) -> int:
        return 0

    async def num_live_leases(self, batch_id: str, now: float) -> int:
        row = await self._one("SELECT COUNT(*) FROM items WHERE batch_id = %s AND state = 'leased' "
                              "AND lease_until >= %s", (batch_id, now))
        return int(row[0])

    async def begin_finalizing(self, batch_id: str, now: int) -> BatchJob | None:
        async with self._connection() as conn, conn.transaction():
            await conn.execute("UPDATE batches SET status = %s, finalizing_at = %s WHERE id = %s AND status = %s "
                               "AND num_completed + num_failed >= num_total",
                               (BatchStatus.FINALIZING.value, now, batch_id, BatchStatus.IN_PROGRESS.value))
            row = await (await conn.execute(_BATCH_BY_ID, (batch_id,))).fetchone()
        batch = rows.batch_of(row) if row else None
        return batch if batch is not None and batch.status is BatchStatus.FINALIZING else None

    async def finalize(self, batch_id: str, status: BatchStatus, leftover: LeftoverLine | None,
                       now: int) -> BatchJob | None:
        async with self._connection() as conn, conn.transaction():
            row = await (await conn.execute(_BATCH_BY_ID + " FOR UPDATE", (batch_id,))).fetchone()
            batch = rows.batch_of(row) if row else None
            if batch is None or not batch.is_active:
                return batch
            left = await (await conn.execute("SELECT idx, custom_id FROM items WHERE batch_id = %s "
                                             "AND state != 'done'", (batch_id,))).fetchall()
            if left and leftover is None:
                return None
            if left and leftover is not None:
                await conn.cursor().executemany(
                    "UPDATE items SET state = 'done', is_error = 1, line = %s, lease_token = NULL "
                    "WHERE batch_id = %s AND idx = %s", [(leftover(c), batch_id, i) for i, c in left])
            file_ids = await _write_files(conn, batch_id, batch.owner, now, rows.output_expires_at(batch, now))
            await conn.execute(f"UPDATE batches SET status = %s, finalizing_at = COALESCE(finalizing_at, %s), "
                               f"{rows.FINAL_STAMP[status]} = %s, output_file_id = %s, error_file_id = %s "
                               "WHERE id = %s",
                               (status.value, now, now, *file_ids, batch_id))
            final = await (await conn.execute(_BATCH_BY_ID, (batch_id,))).fetchone()
            return rows.batch_of(final)  # type: ignore[arg-type]

    async def result_lines(self, batch_id: str, after_idx: int, limit: int) -> list[ResultLine]:
        before = after_idx + limit + 1
        async with self._connection() as conn:
            for state in ("queued", "leased"):  # the first item without a line ends the page
                row = await (await conn.execute(_FIRST_IN_STATE, (batch_id, state, after_idx))).fetchone()
                if row is not None:
                    before = min(before, row[0])
            cur = await conn.execute("SELECT idx, line, is_error FROM items WHERE batch_id = %s AND idx > %s "
                                     "AND idx < %s ORDER BY idx", (batch_id, after_idx, before))
            return [ResultLine(r[0], bytes(r[1]), bool(r[2])) for r in await cur.fetchall()]


async def _why_unreachable(dsn: str) -> str:
    """What connecting to `dsn` answers now (libpq's message names the host and port, never the
    password)."""
    try:
        conn = await AsyncConnection.connect(dsn, connect_timeout=5)
    except psycopg.Error as exc:
        return " ".join(str(exc).split())
    await conn.close()
    return "it answers now; try again"


async def _reconnect_again(pool: AsyncConnectionPool[Any]) -> None:
    """The pool gave up a connection attempt (after `reconnect_s`): start a fresh one at once, so
    that it keeps trying about once a second rather than waiting for the next call to ask."""
    if not pool.closed:
        await pool.check()


async def _write_files(conn: AsyncConnection[Any], batch_id: str, owner: str, now: int,
                       expires_at: int | None) -> list[str | None]:
    """The output and error files from the items' lines in input order, written in parts as a
    server-side cursor reads the lines (never the whole file in memory); their ids, None for a
    file with no line. Runs inside `finalize`'s transaction."""
    writers = (rows.PartWriter("output"), rows.PartWriter("errors"))

    async def write(writer: rows.PartWriter, part: bytes | None) -> None:
        if part is not None:
            await conn.execute("INSERT INTO file_parts (file_id, part, data) VALUES (%s, %s, %s)",
                               (writer.file_id, writer.num_parts, part))

    async with conn.cursor(name=f"lines_{batch_id}") as lines:
        lines.itersize = 1000
        await lines.execute("SELECT line, is_error FROM items WHERE batch_id = %s ORDER BY idx", (batch_id,))
        async for line, is_error in lines:
            writer = writers[1 if is_error else 0]
            await write(writer, writer.add(bytes(line)))
    for writer in writers:
        await write(writer, writer.take())
        if writer.num_bytes:
            await conn.execute("INSERT INTO files (id, owner, filename, purpose, bytes, created_at, content, "
                               "expires_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                               (writer.file_id, owner, f"{batch_id}_{writer.suffix}.jsonl", "batch_output",
                                writer.num_bytes, now, b"", expires_at))
    return [writer.file_id if writer.num_bytes else None for writer in writers]


async def _number_batches(conn: AsyncConnection[Any]) -> None:
    """Make `batches.seq` an identity column, so that batches created at once on several connections
    never share a place in the list. A table from before it was one (where `MAX(seq) + 1` could repeat
    under concurrent inserts) is renumbered first, keeping its order, then indexed as unique."""
    row = await (await conn.execute(
        "SELECT is_identity FROM information_schema.columns WHERE table_schema = current_schema() "
        "AND table_name = 'batches' AND column_name = 'seq'")).fetchone()
    if row is not None and row[0] == "YES":
        return
    await conn.execute("UPDATE batches SET seq = numbered.n FROM (SELECT id, row_number() OVER "
                       "(ORDER BY seq, created_at, id) AS n FROM batches) AS numbered "
                       "WHERE batches.id = numbered.id AND batches.seq <> numbered.n")
    await conn.execute(rows.UNIQUE_SEQ)
    count = await (await conn.execute("SELECT COUNT(*) FROM batches")).fetchone()
    start = int(count[0]) + 1 if count else 1
    await conn.execute(f"ALTER TABLE batches ALTER COLUMN seq ADD GENERATED BY DEFAULT AS IDENTITY "
                       f"(START WITH {start})")


def _num_returned(cur: Any) -> int:
    count = 0
    while True:
        count += cur.rowcount if cur.rowcount > 0 else 0
        if not cur.nextset():
            return count


async def _put_events(conn: AsyncConnection[Any], response_id: str, events: Sequence[Event]) -> None:
    if events:
        async with conn.cursor() as cur:
            await cur.executemany("INSERT INTO response_events (response_id, seq, data) VALUES (%s, %s, %s)",
                                  [(response_id, seq, data) for seq, data in events])


async def _append_items(conn: AsyncConnection[Any], conversation_id: str, items: Sequence[tuple[str, bytes]]) -> None:
    """After the conversation's last item (its row is locked, or new, in this transaction)."""
    (first,) = await (await conn.execute(_CONVERSATIONS.next_seq, (conversation_id,))).fetchone()  # type: ignore[misc]
    async with conn.cursor() as cur:
        await cur.executemany(_CONVERSATIONS.add_item, [(conversation_id, first + i, item_id, data)
                                                        for i, (item_id, data) in enumerate(items)])

"""The JobStore contract, run against both backends: SQLite (embedded) and a real PostgreSQL."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sluice.jobs.postgres_store import PostgresJobStore
from sluice.jobs.sqlite_store import SqliteJobStore
from sluice.jobs.store import BatchStatus, ItemOutcome, JobStore, NewBatch, NewItem, StoredConversation

NOW = 1_700_000_000


def _new_batch(owner: str = "acme") -> NewBatch:
    return NewBatch(owner, "/v1/embeddings", "file-x", "24h", {"k": "v"}, NOW, NOW + 86_400)


async def _started(store: JobStore, num_items: int, owner: str = "acme") -> str:
    batch = await store.create_batch(_new_batch(owner))
    items = [NewItem(i, f"req-{i}", "/v1/embeddings", b'{"input": "x"}') for i in range(num_items)]
    assert await store.start_batch(batch.id, items, NOW)
    return batch.id


def _done(item_batch: str, idx: int, is_error: bool = False) -> ItemOutcome:
    return ItemOutcome(item_batch, idx, f'{{"custom_id": "req-{idx}"}}\n'.encode(), is_error, input_tokens=2,
                       output_tokens=3, cached_tokens=1, reasoning_tokens=2)


async def test_files_round_trip_and_are_scoped_to_their_owner(store: JobStore):
    created = await store.create_file("acme", "in.jsonl", "batch", b"hello\n", NOW)
    assert created.bytes == 6 and created.id.startswith("file-")
    assert await store.get_file("acme", created.id) == created
    assert await store.file_content("acme", created.id) == b"hello\n"
    assert await store.get_file("other", created.id) is None
    assert await store.file_content("other", created.id) is None
    assert not await store.delete_file("other", created.id)
    assert await store.delete_file("acme", created.id)
    assert await store.get_file("acme", created.id) is None


async def test_idempotency_key_returns_the_original(store: JobStore):
    first = await store.create_file("acme", "a.jsonl", "batch", b"1", NOW, idempotency_key="k1")
    again = await store.create_file("acme", "b.jsonl", "batch", b"22", NOW, idempotency_key="k1")
    assert again == first
    other_tenant = await store.create_file("zeta", "a.jsonl", "batch", b"1", NOW, idempotency_key="k1")
    assert other_tenant.id != first.id
    batch = await store.create_batch(_new_batch(), idempotency_key="b1")
    assert (await store.create_batch(_new_batch(), idempotency_key="b1")).id == batch.id
    assert (await store.create_batch(_new_batch())).id != batch.id
    assert len(await store.list_batches("acme", None, 100)) == 2


async def test_list_batches_pages_newest_first(store: JobStore):
    ids = [(await store.create_batch(_new_batch())).id for _ in range(5)]
    await store.create_batch(_new_batch("other"))
    first = await store.list_batches("acme", None, 2)
    assert [b.id for b in first] == ids[::-1][:2]
    rest = await store.list_batches("acme", first[-1].id, 10)
    assert [b.id for b in rest] == ids[::-1][2:]
    assert (await store.get_batch("acme", ids[0])).metadata == {"k": "v"}  # type: ignore[union-attr]
    assert await store.get_batch("other", ids[0]) is None


async def test_claims_lease_each_item_once_and_expired_leases_return(store: JobStore):
    batch_id = await _started(store, 10)
    first = await store.claim(6, lease_s=30, now=NOW)
    second = await store.claim(6, lease_s=30, now=NOW)
    assert first is not None and second is not None
    assert [i.idx for i in first.items] == [0, 1, 2, 3, 4, 5]
    assert [i.idx for i in second.items] == [6, 7, 8, 9]
    assert await store.claim(6, lease_s=30, now=NOW + 1) is None
    assert await store.num_live_leases(batch_id, NOW + 1) == 10
    later = await store.claim(20, lease_s=30, now=NOW + 31)  # both leases expired
    assert later is not None and len(later.items) == 10
    # the old lease holders can no longer write results
    assert await store.record(first.token, [_done(batch_id, 0)]) == 0
    assert await store.record(later.token, [_done(batch_id, 0)]) == 1
    assert await store.record(later.token, [_done(batch_id, 0)]) == 0  # exactly once
    batch = await store.get_batch(None, batch_id)
    assert batch is not None and batch.num_completed == 1
    assert (batch.input_tokens, batch.output_tokens, batch.cached_tokens, batch.reasoning_tokens) == (2, 3, 1, 2)


async def test_concurrent_claims_never_share_an_item(store: JobStore):
    await _started(store, 200)
    claims = await asyncio.gather(*(store.claim(15, lease_s=30, now=NOW) for _ in range(20)))
    seen = [i.idx for c in claims if c is not None for i in c.items]
    assert sorted(seen) == list(range(200))


async def test_retry_requeues_after_its_backoff(store: JobStore):
    batch_id = await _started(store, 1)
    claim = await store.claim(5, lease_s=30, now=NOW)
    assert claim is not None
    retry = ItemOutcome(batch_id, 0, retry_at=NOW + 10, attempts=1)
    assert await store.record(claim.token, [retry]) == 1
    assert await store.claim(5, lease_s=30, now=NOW + 5) is None
    again = await store.claim(5, lease_s=30, now=NOW + 10)
    assert again is not None and again.items[0].attempts == 1


async def test_finalize_assembles_files_in_input_order(store: JobStore):
    batch_id = await _started(store, 4)
    claim = await store.claim(10, lease_s=30, now=NOW)
    assert claim is not None
    await store.record(claim.token, [_done(batch_id, 3), _done(batch_id, 1, is_error=True)])
    assert await store.finalize(batch_id, BatchStatus.COMPLETED, None, NOW) is None  # items left
    await store.record(claim.token, [_done(batch_id, 0), _done(batch_id, 2)])
    lines = await store.result_lines(batch_id, 0, 10)
    assert [r.idx for r in lines] == [1, 2, 3]
    final = await store.finalize(batch_id, BatchStatus.COMPLETED, None, NOW + 5)
    assert final is not None and final.status is BatchStatus.COMPLETED and final.completed_at == NOW + 5
    assert (final.num_completed, final.num_failed, final.num_total) == (3, 1, 4)
    output = await store.file_content("acme", final.output_file_id or "")
    errors = await store.file_content("acme", final.error_file_id or "")
    assert output == b'{"custom_id": "req-0"}\n{"custom_id": "req-2"}\n{"custom_id": "req-3"}\n'
    assert errors == b'{"custom_id": "req-1"}\n'
    assert await store.finalize(batch_id, BatchStatus.COMPLETED, None, NOW + 9) == final  # idempotent


async def test_cancel_keeps_finished_items_and_writes_off_the_rest(store: JobStore):
    batch_id = await _started(store, 3)
    claim = await store.claim(1, lease_s=30, now=NOW)
    assert claim is not None
    await store.record(claim.token, [_done(batch_id, 0)])
    cancelling = await store.cancel_batch("acme", batch_id, NOW)
    assert cancelling is not None and cancelling.status is BatchStatus.CANCELLING
    assert await store.cancel_batch("other", batch_id, NOW) is None
    assert await store.claim(5, lease_s=30, now=NOW) is None  # nothing new starts
    final = await store.finalize(batch_id, BatchStatus.CANCELLED, lambda cid: f"{cid} cancelled\n".encode(), NOW)
    assert final is not None and final.status is BatchStatus.CANCELLED
    assert await store.file_content("acme", final.error_file_id or "") == b"req-1 cancelled\nreq-2 cancelled\n"
    assert [b.id for b in await store.active_batches()] == []


async def test_validation_failure_is_final(store: JobStore):
    batch = await store.create_batch(_new_batch())
    assert [b.id for b in await store.active_batches()] == [batch.id]
    errors: list[dict[str, object]] = [{"code": "invalid_json", "message": "bad", "param": None, "line": 2}]
    await store.fail_batch(batch.id, errors, NOW)
    failed = await store.get_batch("acme", batch.id)
    assert failed is not None and failed.status is BatchStatus.FAILED and failed.errors == errors
    assert not await store.start_batch(batch.id, [], NOW)


async def test_finalizing_is_committed_before_the_files_and_only_once_every_item_is_done(store: JobStore):
    batch_id = await _started(store, 2)
    claim = await store.claim(10, lease_s=30, now=NOW)
    assert claim is not None
    await store.record(claim.token, [_done(batch_id, 0)])
    assert await store.begin_finalizing(batch_id, NOW + 1) is None  # one item left
    await store.record(claim.token, [_done(batch_id, 1)])
    finalizing = await store.begin_finalizing(batch_id, NOW + 2)
    assert finalizing is not None and finalizing.status is BatchStatus.FINALIZING
    assert finalizing.finalizing_at == NOW + 2
    assert finalizing.output_file_id is None and finalizing.is_active
    assert await store.get_batch("acme", batch_id) == finalizing  # what a polling client sees
    assert await store.begin_finalizing(batch_id, NOW + 3) == finalizing  # again (a resumed server): unchanged
    final = await store.finalize(batch_id, BatchStatus.COMPLETED, None, NOW + 4)
    assert final is not None and final.status is BatchStatus.COMPLETED
    assert (final.finalizing_at, final.completed_at) == (NOW + 2, NOW + 4) and final.output_file_id
    assert await store.begin_finalizing(batch_id, NOW + 5) is None


async def test_items_stored_in_chunks_after_the_start_run_while_the_rest_arrive(store: JobStore):
    batch = await store.create_batch(_new_batch())
    items = [NewItem(i, f"req-{i}", "/v1/embeddings", b'{"input": "x"}') for i in range(10)]
    assert await store.start_batch(batch.id, items[:3], NOW, num_total=10)
    started = await store.get_batch(None, batch.id)
    assert started is not None and started.status is BatchStatus.IN_PROGRESS and started.num_total == 10
    assert await store.num_items(batch.id) == 3
    claim = await store.claim(20, lease_s=30, now=NOW)
    assert claim is not None and [i.idx for i in claim.items] == [0, 1, 2]
    await store.record(claim.token, [_done(batch.id, i) for i in range(3)])
    assert await store.begin_finalizing(batch.id, NOW) is None  # 7 items are not even stored yet
    await store.add_items(batch.id, items[3:8])
    await store.add_items(batch.id, items[5:])  # a resumed load may repeat a chunk: kept once
    assert await store.num_items(batch.id) == 10
    later = await store.claim(20, lease_s=30, now=NOW)
    assert later is not None and [i.idx for i in later.items] == list(range(3, 10))


async def test_result_lines_stop_at_the_first_item_without_a_line(store: JobStore):
    batch_id = await _started(store, 5)
    claim = await store.claim(10, lease_s=30, now=NOW)
    assert claim is not None
    await store.record(claim.token, [_done(batch_id, 0), _done(batch_id, 1, is_error=True), _done(batch_id, 3)])
    assert [r.idx for r in await store.result_lines(batch_id, -1, 100)] == [0, 1]  # 2 still runs: no hole
    assert await store.result_lines(batch_id, 1, 100) == []
    await store.record(claim.token, [_done(batch_id, 2)])
    assert [r.idx for r in await store.result_lines(batch_id, 1, 100)] == [2, 3]
    assert [r.idx for r in await store.result_lines(batch_id, -1, 2)] == [0, 1]  # pages of `limit`


async def test_batches_created_at_once_are_each_listed_once(store: JobStore):
    """Concurrent creations (PostgreSQL: on several pooled connections at once) each get their own
    place in the list, so paging with `after` reaches every one of them exactly once."""
    created = await asyncio.gather(*(store.create_batch(_new_batch()) for _ in range(40)))
    listed: list[str] = []
    after = None
    while True:
        page = await store.list_batches("acme", after, 3)
        if not page:
            break
        listed += [b.id for b in page]
        after = page[-1].id
    assert sorted(listed) == sorted(b.id for b in created)


async def test_a_postgres_table_from_before_the_identity_column_is_renumbered_in_order(postgres_dsn: str):
    """Batches stored by an older sluice (`seq = MAX(seq) + 1`, two of them sharing a seq) keep their
    order, and each gets its own place, when a new one connects; new batches come after them."""
    import psycopg

    from sluice.jobs import rows

    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        for statement in rows.SCHEMA.format(blob="BYTEA", real="DOUBLE PRECISION", int="BIGINT").split(";"):
            if statement.strip():
                conn.execute(statement)
        for batch_id, seq in (("batch_a", 1), ("batch_b", 2), ("batch_c", 2), ("batch_d", 3)):
            conn.execute("INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, "
                         "created_at, expires_at, seq) VALUES (%s, 'acme', '/v1/embeddings', 'file-x', '24h', "
                         "'completed', %s, %s, %s)", (batch_id, NOW, NOW + 1, seq))
    store = await PostgresJobStore.connect(postgres_dsn)
    try:
        newest = await store.create_batch(_new_batch())
        first = await store.list_batches("acme", None, 2)
        rest = await store.list_batches("acme", first[-1].id, 10)
        assert [b.id for b in first + rest] == [newest.id, "batch_d", "batch_c", "batch_b", "batch_a"]
    finally:
        await store.aclose()
    again = await PostgresJobStore.connect(postgres_dsn)  # connecting again changes nothing
    try:
        assert [b.id for b in await again.list_batches("acme", None, 10)][:2] == [newest.id, "batch_d"]
    finally:
        await again.aclose()


async def test_files_list_by_owner_purpose_and_cursor(store: JobStore):
    ids = [(await store.create_file("acme", f"f{i}", "batch", b"x", NOW + i)).id for i in range(4)]
    output = await store.create_file("acme", "out", "batch_output", b"y", NOW + 9)
    await store.create_file("zeta", "z", "batch", b"z", NOW)
    assert [f.id for f in await store.list_files("acme", None, None, 10)] == [output.id, *ids[::-1]]
    assert [f.id for f in await store.list_files("acme", "batch", ids[2], 10)] == [ids[1], ids[0]]
    assert [f.id for f in await store.list_files("acme", "batch", ids[1], 10, ascending=True)] == ids[2:]
    assert [f.id for f in await store.list_files("acme", "batch_output", None, 10)] == [output.id]


async def test_find_batch_by_its_idempotency_key(store: JobStore):
    batch = await store.create_batch(_new_batch(), idempotency_key="k")
    assert await store.find_batch("acme", "k") == batch
    assert await store.find_batch("zeta", "k") is None and await store.find_batch("acme", "other") is None


async def test_output_files_are_written_and_read_in_parts(store: JobStore, monkeypatch: pytest.MonkeyPatch):
    """An output file is stored in parts of about FILE_PART_BYTES (whole lines), never as one value
    (SQLite and PostgreSQL cap a value near 1 GB), and read back a part at a time."""
    from sluice.jobs import rows

    monkeypatch.setattr(rows, "FILE_PART_BYTES", 100)
    batch_id = await _started(store, 40)
    claim = await store.claim(100, lease_s=30, now=NOW)
    assert claim is not None
    await store.record(claim.token, [_done(batch_id, i, is_error=i % 10 == 0) for i in range(40)])
    final = await store.finalize(batch_id, BatchStatus.COMPLETED, None, NOW)
    assert final is not None and final.output_file_id and final.error_file_id
    expected = b"".join(f'{{"custom_id": "req-{i}"}}\n'.encode() for i in range(40) if i % 10)
    assert await store.file_content("acme", final.output_file_id) == expected
    parts, index = [], 0
    while (part := await store.file_part("acme", final.output_file_id, index)) is not None:
        parts.append(part)
        index += 1
    assert b"".join(parts) == expected and len(parts) > 5 and max(len(p) for p in parts) < 100 + 30
    assert all(p.endswith(b"\n") for p in parts if p)  # whole lines
    assert (await store.get_file("acme", final.output_file_id)).bytes == len(expected)  # type: ignore[union-attr]
    assert await store.file_part("other", final.output_file_id, 1) is None  # scoped to its owner
    assert await store.delete_file("acme", final.output_file_id)
    assert await store.file_part("acme", final.output_file_id, 1) is None


async def test_stored_responses_are_the_owners_and_go_when_deleted_or_old(store: JobStore):
    await store.put_response("acme", "resp_1", NOW, b'{"id": "resp_1"}', b'[{"role": "user"}]')
    await store.put_response("acme", "resp_2", NOW + 100, b'{"id": "resp_2"}', b"[]")
    found = await store.get_response("acme", "resp_1")
    assert found is not None and (found.body, found.input_items) == (b'{"id": "resp_1"}', b'[{"role": "user"}]')
    assert await store.get_response("other", "resp_1") is None, "another tenant cannot read it"
    assert not await store.delete_response("other", "resp_1")
    assert await store.delete_response("acme", "resp_1")
    assert await store.get_response("acme", "resp_1") is None and not await store.delete_response("acme", "resp_1")
    await store.put_response("acme", "resp_3", NOW - 100, b"{}", b"[]")
    assert await store.delete_responses_before(NOW) == 1
    assert await store.get_response("acme", "resp_3") is None and await store.get_response("acme", "resp_2")


async def test_a_background_response_runs_under_one_lease_until_answered_cancelled_or_taken_over(store: JobStore):
    await store.put_response_run("acme", "resp_b", NOW, b'{"status": "queued"}', b"[]", b"req", "gw-1", NOW + 30)
    assert (await store.get_response("acme", "resp_b")).body == b'{"status": "queued"}'  # type: ignore[union-attr]
    assert await store.claim_response_runs("gw-2", NOW + 10, NOW + 40, 10) == [], "its lease is live"
    assert await store.update_response_run("resp_b", "gw-1", b'{"status": "in_progress"}', is_final=False)
    assert not await store.update_response_run("resp_b", "gw-2", b'{"status": "x"}', is_final=False)
    assert await store.renew_response_runs("gw-1", ["resp_b", "resp_gone"], NOW + 60) == {"resp_b"}
    assert await store.renew_response_runs("gw-2", ["resp_b"], NOW + 90) == set(), "not gw-2's"

    # gw-1 stops renewing: once the lease has run out, another gateway takes the run over, once
    [taken] = await store.claim_response_runs("gw-2", NOW + 61, NOW + 91, 10)
    assert (taken.owner, taken.response_id, taken.request, taken.attempts) == ("acme", "resp_b", b"req", 2)
    assert await store.claim_response_runs("gw-3", NOW + 61, NOW + 91, 10) == []
    assert not await store.update_response_run("resp_b", "gw-1", b'{"status": "late"}', is_final=True)
    assert await store.renew_response_runs("gw-1", ["resp_b"], NOW + 99) == set(), "gw-1 learns it lost it"
    assert await store.update_response_run("resp_b", "gw-2", b'{"status": "completed"}', is_final=True)
    assert (await store.get_response("acme", "resp_b")).body == b'{"status": "completed"}'  # type: ignore[union-attr]
    assert not await store.cancel_response_run("acme", "resp_b", b'{"status": "cancelled"}'), "answered already"
    assert await store.claim_response_runs("gw-3", NOW + 10_000, NOW + 10_030, 10) == []

    # a cancel ends the run whoever holds it; the holder's answer is then not written
    await store.put_response_run("acme", "resp_c", NOW, b'{"status": "queued"}', b"[]", b"req", "gw-1", NOW + 30)
    assert not await store.cancel_response_run("other", "resp_c", b"{}"), "another tenant cannot cancel it"
    assert await store.cancel_response_run("acme", "resp_c", b'{"status": "cancelled"}')
    assert not await store.update_response_run("resp_c", "gw-1", b'{"status": "completed"}', is_final=True)
    assert (await store.get_response("acme", "resp_c")).body == b'{"status": "cancelled"}'  # type: ignore[union-attr]
    assert await store.renew_response_runs("gw-1", ["resp_c"], NOW + 60) == set()

    # deleting a running response, or its retention ending, takes its run too
    await store.put_response_run("acme", "resp_d", NOW, b"{}", b"[]", b"req", "gw-1", NOW + 30)
    await store.put_response_run("acme", "resp_e", NOW - 100, b"{}", b"[]", b"req", "gw-1", NOW + 30)
    assert await store.delete_response("acme", "resp_d")
    assert await store.delete_responses_before(NOW) == 1
    assert await store.claim_response_runs("gw-2", NOW + 10_000, NOW + 10_030, 10) == []


async def test_a_single_server_store_frees_background_runs_at_startup(tmp_path: Path):
    """SQLite has one server per data directory: at startup nobody else can hold a run's lease."""
    store = SqliteJobStore(tmp_path / "data")
    await store.put_response_run("acme", "resp_r", NOW, b"{}", b"[]", b"req", "gw-dead", 2e9)
    await store.release_leases()
    [taken] = await store.claim_response_runs("gw-new", NOW, NOW + 30, 10)
    assert taken.response_id == "resp_r" and taken.attempts == 2
    await store.aclose()


async def _num_file_parts(store: JobStore) -> int:
    """Rows in `file_parts`, whoever's (a file deleted must leave none behind)."""
    if isinstance(store, SqliteJobStore):
        return await store._call(lambda db: int(db.execute("SELECT COUNT(*) FROM file_parts").fetchone()[0]),
                                 store._db)
    assert isinstance(store, PostgresJobStore)
    return int((await store._one("SELECT COUNT(*) FROM file_parts", ()))[0])


async def test_files_past_their_expiry_are_deleted_with_their_content(store: JobStore,
                                                                      monkeypatch: pytest.MonkeyPatch):
    """An upload's `expires_after` and a batch's `output_expires_after` (its output and error files,
    from when they are written) set `expires_at`; `delete_expired_files` removes the row and every
    part of the content once it has come, and nothing else."""
    from sluice.jobs import rows

    monkeypatch.setattr(rows, "FILE_PART_BYTES", 50)
    expiring = await store.create_file("acme", "in.jsonl", "batch", b"x", NOW, expires_at=NOW + 3600)
    kept = await store.create_file("acme", "keep.jsonl", "batch", b"y", NOW)
    assert (expiring.expires_at, kept.expires_at) == (NOW + 3600, None)
    assert (await store.get_file("acme", expiring.id)) == expiring
    batch = await store.create_batch(NewBatch("acme", "/v1/embeddings", kept.id, "24h", None, NOW, NOW + 86_400,
                                              output_expires_after_s=7200))
    assert batch.output_expires_after_s == 7200
    assert await store.start_batch(batch.id, [NewItem(i, f"req-{i}", "/v1/embeddings", b"{}") for i in range(20)],
                                   NOW)
    claim = await store.claim(100, lease_s=30, now=NOW)
    assert claim is not None
    await store.record(claim.token, [_done(batch.id, i, is_error=i % 5 == 0) for i in range(20)])
    final = await store.finalize(batch.id, BatchStatus.COMPLETED, None, NOW + 100)
    assert final is not None and final.output_file_id and final.error_file_id
    output = await store.get_file("acme", final.output_file_id)
    assert output is not None and output.expires_at == NOW + 100 + 7200  # anchored at the file's creation
    assert await _num_file_parts(store) > 2
    assert await store.delete_expired_files(NOW + 3599) == 0
    assert await store.delete_expired_files(NOW + 3600) == 1
    assert await store.get_file("acme", expiring.id) is None and await store.file_content("acme", expiring.id) is None
    assert await store.get_file("acme", final.output_file_id) is not None
    assert await store.delete_expired_files(NOW + 100 + 7200) == 2  # the output and error files
    assert await store.file_part("acme", final.output_file_id, 0) is None
    assert await _num_file_parts(store) == 0
    assert [f.id for f in await store.list_files("acme", None, None, 10)] == [kept.id]


async def test_postgres_deletes_an_expired_file_whole_or_not_at_all_while_another_commits_one(postgres_dsn: str):
    """Expiry on PostgreSQL (READ COMMITTED) while another gateway commits an expired file with its
    parts: the file is deleted with its parts, or left whole for the next round; never its row
    without its parts, which nothing would ever delete. The other transaction holds a lock that the
    deletion waits for, and commits its file while it waits."""
    import psycopg

    async def orphaned_parts() -> int:
        return int((await store._one("SELECT COUNT(*) FROM file_parts p WHERE NOT EXISTS "
                                     "(SELECT 1 FROM files f WHERE f.id = p.file_id)", ()))[0])

    def add_file(conn: psycopg.Connection, file_id: str) -> None:
        conn.execute("INSERT INTO files (id, owner, filename, purpose, bytes, created_at, content, expires_at) "
                     "VALUES (%s, 'acme', 'out.jsonl', 'batch_output', 2, %s, ''::bytea, %s)", (file_id, NOW, NOW))
        conn.execute("INSERT INTO file_parts (file_id, part, data) VALUES (%s, 1, 'x'::bytea)", (file_id,))

    store = await PostgresJobStore.connect(postgres_dsn)
    other = await asyncio.to_thread(psycopg.connect, postgres_dsn)
    try:
        with other.transaction():
            add_file(other, "file-first")
        other.execute("SELECT 1 FROM file_parts WHERE file_id = 'file-first' FOR UPDATE")  # its transaction stays open
        deleting = asyncio.create_task(store.delete_expired_files(NOW))
        for _ in range(1000):  # until the deletion waits for that lock
            waiting = await store._one("SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                       "AND datname = current_database()", ())
            if waiting[0]:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the deletion never waited for the lock")
        add_file(other, "file-late")
        other.commit()
        await asyncio.wait_for(deleting, 30)
        assert await orphaned_parts() == 0
        assert await store.get_file("acme", "file-first") is None
        await store.delete_expired_files(NOW)  # the next round takes what the first did not
        assert await store.get_file("acme", "file-late") is None
        assert await store._one("SELECT COUNT(*) FROM file_parts", ()) == (0,)
    finally:
        other.close()
        await store.aclose()


OLD_FILES_AND_BATCHES = """
CREATE TABLE files (id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes {int} NOT NULL, created_at {int} NOT NULL, content {blob} NOT NULL, idempotency_key TEXT,
    UNIQUE (owner, idempotency_key));
CREATE TABLE batches (id TEXT PRIMARY KEY, owner TEXT NOT NULL, endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL, metadata TEXT,
    created_at {int} NOT NULL, expires_at {int} NOT NULL, num_total {int} NOT NULL DEFAULT 0,
    num_completed {int} NOT NULL DEFAULT 0, num_failed {int} NOT NULL DEFAULT 0,
    input_tokens {int} NOT NULL DEFAULT 0, output_tokens {int} NOT NULL DEFAULT 0, in_progress_at {int},
    finalizing_at {int}, completed_at {int}, failed_at {int}, expired_at {int}, cancelling_at {int},
    cancelled_at {int}, output_file_id TEXT, error_file_id TEXT, errors TEXT, idempotency_key TEXT,
    seq {int} NOT NULL, UNIQUE (owner, idempotency_key));
INSERT INTO files (id, owner, filename, purpose, bytes, created_at, content)
    VALUES ('file-old', 'acme', 'old.jsonl', 'batch', 1, 1700000000, {x});
INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, created_at, expires_at, seq)
    VALUES ('batch_old', 'acme', '/v1/embeddings', 'file-old', '24h', 'validating', 1700000000, 1700086400, 1)
"""
"""The `files` and `batches` tables as sluice made them before files could expire, with a row each."""


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_a_database_from_before_files_expired_is_upgraded_in_place(backend: str, tmp_path: Path,
                                                                         request: pytest.FixtureRequest):
    """Opening a database made by the previous schema adds the expiry columns (once: opening it again
    changes nothing); its rows read as never expiring, and new files and batches can expire."""
    import sqlite3

    async def opened() -> JobStore:
        if backend == "sqlite":
            return SqliteJobStore(tmp_path / "data")
        return await PostgresJobStore.connect(dsn)

    if backend == "sqlite":
        (tmp_path / "data").mkdir()
        with sqlite3.connect(tmp_path / "data" / "jobs.sqlite3") as db:
            db.executescript(OLD_FILES_AND_BATCHES.format(int="INTEGER", blob="BLOB", x="X'78'"))
    else:
        import psycopg

        dsn = request.getfixturevalue("postgres_dsn")
        with psycopg.connect(dsn, autocommit=True) as conn:
            for statement in OLD_FILES_AND_BATCHES.format(int="BIGINT", blob="BYTEA", x="'\\x78'::bytea").split(";"):
                conn.execute(statement)
    for _ in range(2):
        store = await opened()
        try:
            old = await store.get_file("acme", "file-old")
            assert old is not None and old.expires_at is None and await store.file_content("acme", old.id) == b"x"
            old_batch = await store.get_batch("acme", "batch_old")
            assert old_batch is not None and old_batch.output_expires_after_s is None
            assert (old_batch.cached_tokens, old_batch.reasoning_tokens) == (0, 0)
            new = await store.create_file("acme", "new.jsonl", "batch", b"y", NOW, expires_at=NOW + 3600)
            assert (await store.get_file("acme", new.id)) == new and new.expires_at == NOW + 3600
            batch = await store.create_batch(NewBatch("acme", "/v1/embeddings", new.id, "24h", None, NOW, NOW + 1,
                                                      output_expires_after_s=3600))
            assert batch.output_expires_after_s == 3600
            assert await store.delete_expired_files(NOW + 3600) == 1
            assert await store.get_file("acme", "file-old") is not None
        finally:
            await store.aclose()


async def test_a_conversation_keeps_its_items_in_order_for_its_owner_until_deleted(store: JobStore):
    await store.create_conversation("acme", "conv_1", NOW, b'{"k":"v"}', [("a", b'{"id":"a"}'), ("b", b'{"id":"b"}')])
    assert await store.add_conversation_items("acme", "conv_1", [("c", b'{"id":"c"}')])
    assert await store.add_conversation_items("acme", "conv_1", [])
    found = await store.get_conversation("acme", "conv_1", with_items=True)
    assert found == StoredConversation(NOW, b'{"k":"v"}', (b'{"id":"a"}', b'{"id":"b"}', b'{"id":"c"}'))
    assert await store.get_conversation("acme", "conv_1") == StoredConversation(NOW, b'{"k":"v"}')
    # another tenant's: not found, not changed
    assert await store.get_conversation("other", "conv_1") is None
    assert not await store.add_conversation_items("other", "conv_1", [("x", b"{}")])
    assert not await store.update_conversation("other", "conv_1", b"{}")
    assert not await store.delete_conversation_item("other", "conv_1", "a")
    assert not await store.delete_conversation("other", "conv_1")
    assert await store.update_conversation("acme", "conv_1", b'{"k":"w"}')
    assert await store.delete_conversation_item("acme", "conv_1", "b")
    assert not await store.delete_conversation_item("acme", "conv_1", "b")
    assert await store.add_conversation_items("acme", "conv_1", [("d", b'{"id":"d"}')])  # after c, not in b's place
    found = await store.get_conversation("acme", "conv_1", with_items=True)
    assert found == StoredConversation(NOW, b'{"k":"w"}', (b'{"id":"a"}', b'{"id":"c"}', b'{"id":"d"}'))
    assert await store.delete_conversation("acme", "conv_1")
    assert await store.get_conversation("acme", "conv_1") is None
    assert not await store.add_conversation_items("acme", "conv_1", [("e", b"{}")])
    await store.create_conversation("acme", "conv_1", NOW, b"{}", [])  # its id free again; no items left over
    assert (await store.get_conversation("acme", "conv_1", with_items=True)).items == ()


async def test_appends_to_one_conversation_at_once_keep_every_item_once(store: JobStore):
    await store.create_conversation("acme", "conv_1", NOW, b"{}", [])
    await asyncio.gather(*(store.add_conversation_items("acme", "conv_1", [(f"{i}a", b"1"), (f"{i}b", b"2")])
                           for i in range(8)))
    items = (await store.get_conversation("acme", "conv_1", with_items=True)).items
    assert len(items) == 16 and items.count(b"1") == 8 and items.count(b"2") == 8

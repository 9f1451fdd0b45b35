"""CPU per item of the SQLite job store on the executor's path: start a 100,000-item batch, then
claim in leases of 128 and record each lease's outcomes in one transaction, until done; finalize.

    PYTHONPATH=src python benchmarks/jobs_store_overhead.py [num_items]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

from sluice.jobs.sqlite_store import SqliteJobStore
from sluice.jobs.store import BatchStatus, ItemOutcome, NewBatch, NewItem


async def main(num_items: int) -> None:
    store = SqliteJobStore(Path(tempfile.mkdtemp(prefix="sluice-bench-")))
    batch = await store.create_batch(NewBatch("", "/v1/embeddings", "file-x", "24h", None, 0, 2**40))
    body = b'{"model": "emulated", "input": "a short sentence to embed"}'
    items = [NewItem(i, f"req-{i}", "/v1/embeddings", body) for i in range(num_items)]
    line = b'{"id":"batch_req_0123456789abcdef01234567","custom_id":"req-0","response":{"status_code":200,' \
           b'"request_id":"x","body":{"object":"list","data":[{"embedding":[1.0,2.0]}]}},"error":null}\n'
    cpu, wall = time.process_time(), time.perf_counter()
    await store.start_batch(batch.id, items, 0)
    start_cpu = time.process_time() - cpu
    cpu2 = time.process_time()
    while (claim := await store.claim(128, 60, time.time())) is not None:
        await store.record(claim.token, [ItemOutcome(i.batch_id, i.idx, line) for i in claim.items])
    loop_cpu = time.process_time() - cpu2
    cpu3 = time.process_time()
    final = await store.finalize(batch.id, BatchStatus.COMPLETED, None, 1)
    final_cpu = time.process_time() - cpu3
    assert final is not None and final.num_completed == num_items
    total = time.process_time() - cpu
    print(f"{num_items} items: start {start_cpu * 1e3 / num_items:.3f} ms/item, claim+record "
          f"{loop_cpu * 1e3 / num_items:.3f} ms/item, finalize {final_cpu * 1e3 / num_items:.3f} ms/item, "
          f"total {total * 1e3 / num_items:.3f} ms CPU/item, wall {time.perf_counter() - wall:.1f} s")
    await store.aclose()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000))

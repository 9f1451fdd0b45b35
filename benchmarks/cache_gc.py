"""What a full result-cache store costs the gateway's garbage collector.

    PYTHONPATH=src python benchmarks/cache_gc.py [--values 1] [--capacity-mb 256]

Fills a `MemoryStore` of the gateway's default capacity (256 MiB) with answers like the demo
`emulated` model's (one float32 per request, `--values` to change it) until it starts evicting,
as a gateway answering unique requests for an hour (the default TTL) at ~300 req/s would. Then
times full collections (`gc.collect()`, median of 5) and counts the objects the collector tracks.
A full collection in the gateway stops its event loop for that long; CPython runs one whenever
the objects that survived younger collections grow by a quarter of the tracked total, so with a
growing store they recur as it grows.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from sluice import wire
from sluice.clock import MonotonicClock
from sluice.gateway.cache import CachedResult, MemoryStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", type=int, default=1, help="float32 values per answer")
    parser.add_argument("--capacity-mb", type=int, default=256)
    args = parser.parse_args()
    store = MemoryStore(args.capacity_mb * 1024 * 1024, 3600.0, MonotonicClock())
    gc.collect()
    tracked_before = len(gc.get_objects())
    data = bytes(4 * args.values)
    started = time.perf_counter()
    i = 0
    while store.num_evicted == 0:
        store.put(i.to_bytes(16, "big"), CachedResult(wire.TensorPayload("float32", (1, args.values), data), 0))
        i += 1
    fill_s = time.perf_counter() - started
    pauses = []
    for _ in range(5):
        started = time.perf_counter()
        gc.collect()
        pauses.append(time.perf_counter() - started)
    tracked = len(gc.get_objects()) - tracked_before
    print(f"{len(store):,} entries in {store.num_bytes / 2**20:.0f} MiB (filled in {fill_s:.1f} s, "
          f"{fill_s / i * 1e6:.2f} us per put); objects tracked by the GC: +{tracked:,}; "
          f"full collection: median {statistics.median(pauses) * 1000:.1f} ms, "
          f"max {max(pauses) * 1000:.1f} ms")


if __name__ == "__main__":
    main()

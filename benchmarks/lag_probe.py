"""How late this machine wakes a sleeping process: the floor under any latency tail measured here.

    python benchmarks/lag_probe.py [SECONDS]      # alone, or beside a benchmark run

Sleeps 1 ms at a time for SECONDS (default 20) and prints how late each wake-up was (p50, p99,
p99.9, worst, and how many were more than 5 and 20 ms late). On a quiet host every wake-up is
within a fraction of a millisecond; on a VM whose host is busy (`vmstat`'s `st` column: CPU
stolen by the hypervisor) wake-ups tens of milliseconds late appear even with nothing else running.
"""

from __future__ import annotations

import sys
import time

import numpy as np


def main() -> None:
    duration_s = float(sys.argv[1]) if len(sys.argv) > 1 else 20.0
    late: list[float] = []
    end = time.perf_counter() + duration_s
    while time.perf_counter() < end:
        started = time.perf_counter()
        time.sleep(0.001)
        late.append(time.perf_counter() - started - 0.001)
    ms = np.array(late) * 1000
    p50, p99, p999 = np.percentile(ms, [50, 99, 99.9])
    print(f"{len(ms)} wake-ups, late ms: p50 {p50:.2f}, p99 {p99:.2f}, p99.9 {p999:.2f}, worst {ms.max():.1f}; "
          f"over 5 ms: {(ms > 5).sum()}, over 20 ms: {(ms > 20).sum()}")


if __name__ == "__main__":
    main()

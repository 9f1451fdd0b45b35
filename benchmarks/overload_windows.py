"""An open-loop KServe run against a running server, shown second by second.

    python benchmarks/overload_windows.py [--url URL] [--rate 2666] [--duration 20]

`sluice bench` reports a run's percentiles as a whole; this sends the same load (the emulated
model, 16 values per request, Poisson arrivals, 2 s of warm-up, its `LoadGenerator`) and prints
each second's completions and refusals with their p99, so that a tail made in a few bad seconds
(a stall) can be told from one spread over the whole run.
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
import numpy as np

from sluice.bench.loadgen import LoadConfig, LoadGenerator
from sluice.bench.workloads import Endpoint, build_workload, input_specs_from_metadata


async def run(url: str, rate: float, duration_s: float) -> None:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v2/models/emulated") as response:
        metadata = await response.json()
    workload = build_workload(Endpoint.KSERVE, url, "emulated", 16, None, input_specs_from_metadata(metadata))
    samples = await LoadGenerator(workload, 30.0, 2000).run(LoadConfig(rate, duration_s, 2.0))
    sent, latency_ms, status = samples.sent_s, samples.latency_s * 1000, samples.status
    ok, refused = status == 200, status == 503
    print(f"completed {ok.sum() / duration_s:.0f}/s, p50 / p99 {_pcts(latency_ms[ok])}; "
          f"expired {(status == 504).sum()}; refused {refused.sum()}, p50 / p99 {_pcts(latency_ms[refused])}")
    for second in range(int(duration_s)):
        window = (sent >= second) & (sent < second + 1)
        print(f"{second:3d} s  completed {(window & ok).sum():5d}, p99 {_p99(latency_ms[window & ok]):7.1f} ms"
              f"  | refused {(window & refused).sum():5d}, p99 {_p99(latency_ms[window & refused]):7.1f} ms")


def _pcts(values: np.ndarray) -> str:
    return "-" if not len(values) else "{:.1f} / {:.1f} ms".format(*np.percentile(values, [50, 99]))


def _p99(values: np.ndarray) -> float:
    return float(np.percentile(values, 99)) if len(values) else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8765")
    parser.add_argument("--rate", type=float, default=2666.0)
    parser.add_argument("--duration", type=float, default=20.0)
    args = parser.parse_args()
    asyncio.run(run(args.url, args.rate, args.duration))


if __name__ == "__main__":
    main()

"""Latency of answers from the result cache against the same requests run on the device.

    python benchmarks/cache_latency.py --url http://127.0.0.1:8000 [--requests 300]

Against a running `sluice serve` with the demo models: one request at a time (no queueing, so
the difference is the device time and the trip to the worker), each case `--requests` times:
KServe infer on `emulated` and `/v1/embeddings` on `minilm`, once with `Cache-Control: no-store`
(run on the device every time) and once repeating one request (answered from the cache after the
first). Prints the client's median and p99 for each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx


def _measure(client: httpx.Client, path: str, body: dict[str, object], headers: dict[str, str], n: int) -> list[float]:
    seconds = []
    for _ in range(n):
        started = time.perf_counter()
        response = client.post(path, json=body, headers=headers)
        seconds.append(time.perf_counter() - started)
        response.raise_for_status()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    cases = {
        "emulated (KServe infer, 16 values)": ("/v2/models/emulated/infer", {"inputs": [
            {"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [float(i) for i in range(16)]}]}),
        "minilm (/v1/embeddings, one sentence)": ("/v1/embeddings", {
            "model": "minilm", "input": "The result cache answers a repeated sentence without the model."}),
    }
    with httpx.Client(base_url=args.url, timeout=30) as client:
        print(f"{'case':40} {'on the device':>22} {'from the cache':>22}   (median / p99 ms)")
        for name, (path, body) in cases.items():
            _measure(client, path, body, {}, 5)  # warm up, and store the answer
            device = _measure(client, path, body, {"Cache-Control": "no-store"}, args.requests)
            cached = _measure(client, path, body, {}, args.requests)
            print(f"{name:40} {_summary(device):>22} {_summary(cached):>22}")


def _summary(seconds: list[float]) -> str:
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"{statistics.median(ordered) * 1000:.2f} / {p99 * 1000:.2f}"


if __name__ == "__main__":
    main()

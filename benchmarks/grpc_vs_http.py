"""KServe v2 infer through tritonclient over HTTP and over gRPC, against one running server.

    sluice serve --grpc-port 8001 &
    python benchmarks/grpc_vs_http.py [--url 127.0.0.1:8000] [--grpc-url 127.0.0.1:8001] [--requests 500]

Both clients as users run them (binary tensors, tritonclient's defaults), one request at a time
on `emulated` (16 values, `Cache-Control: no-store` so every request runs on the device), the
two protocols alternating in rounds of 50. Prints the client's median and p99 latency and the
gateway's CPU per request for each (from /proc, when the server is a local process).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from collections.abc import Callable

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

ROUND = 50
HEADERS = {"cache-control": "no-store"}  # lowercase: gRPC metadata keys must be


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="127.0.0.1:8000")
    parser.add_argument("--grpc-url", default="127.0.0.1:8001")
    parser.add_argument("--requests", type=int, default=500)
    args = parser.parse_args()
    rows = np.arange(16, dtype=np.float32).reshape(1, 16)
    http = httpclient.InferenceServerClient(args.url)
    grpc = grpcclient.InferenceServerClient(args.grpc_url)
    http_input = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    http_input.set_data_from_numpy(rows)
    grpc_input = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    grpc_input.set_data_from_numpy(rows)
    calls: dict[str, Callable[[], object]] = {
        "HTTP (tritonclient.http)": lambda: http.infer("emulated", [http_input], headers=dict(HEADERS)),
        "gRPC (tritonclient.grpc)": lambda: grpc.infer("emulated", [grpc_input], headers=dict(HEADERS)),
    }
    gateway = _gateway_pid(args.url)
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    cpu: dict[str, float] = dict.fromkeys(calls, 0.0)
    for call in calls.values():
        for _ in range(20):  # warm up
            call()
    for _ in range(max(args.requests // ROUND, 1)):
        for name, call in calls.items():
            before = _cpu_s(gateway)
            for _ in range(ROUND):
                started = time.perf_counter()
                call()
                seconds[name].append(time.perf_counter() - started)
            cpu[name] += _cpu_s(gateway) - before
    print(f"{'protocol':26} {'median / p99 ms':>18} {'gateway CPU per request':>24}")
    for name, values in seconds.items():
        ordered = sorted(values)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        per_request = f"{cpu[name] / len(values) * 1e6:.0f} µs" if gateway else "-"
        print(f"{name:26} {statistics.median(ordered) * 1000:8.2f} / {p99 * 1000:6.2f} {per_request:>24}")


def _gateway_pid(url: str) -> int | None:
    """The local process listening on the HTTP port (the gateway), if there is one."""
    port = url.rpartition(":")[2]
    out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True, check=False).stdout
    marker = "pid="
    return int(out.split(marker, 1)[1].split(",", 1)[0]) if marker in out else None


def _cpu_s(pid: int | None) -> float:
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, in clock ticks


if __name__ == "__main__":
    main()

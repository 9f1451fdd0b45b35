"""Batch jobs on a shared device: the device busy ratio of a job, and the interactive p99 beside one.

Starts `sluice serve` on the emulated model (the demo repository's `emulated`, capacity 1,333
items/s at 16 values per item) with its own data directory, then:

1. `busy`: a job of `--items` embeddings lines runs alone; the device busy ratio is
   Δ`sluice_device_busy_seconds_total` / wall time from `POST /v1/batches` (the file is uploaded
   before) until a poll every 0.1 s sees `completed` (validation and finalization included);
   it also prints the gateway process's CPU time per item over that span.
2. `interactive`: `sluice bench` offers KServe infer requests at `--rate` (666 = 50% of capacity)
   for `--duration` s alone, then again while a job of `--items` lines runs; it prints both p99s
   and their ratio (target: <= 1.10). The job is cancelled once the second window ends. With
   `--rounds N` it alternates the two windows N times (a fresh job for each "with" window) and
   also prints the median of each condition's per-window p99s and their ratio: one host stall
   of 100-200 ms decides a single window's p99 here, and a median over windows is not moved by
   one stalled window.

    python benchmarks/jobs_interactive.py                        # both, 100,000 items, 20 s windows
    python benchmarks/jobs_interactive.py --items 5000 --duration 5 --phases interactive
    python benchmarks/jobs_interactive.py --phases interactive --items 100000 --duration 10 --rounds 11

Run it on a quiet machine: the generator, the gateway, the worker and SQLite share its cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serving import start_server

REPO = Path(__file__).resolve().parents[1]
DEMO_EMULATED = REPO / "src" / "sluice" / "demo_models" / "emulated"
FINAL = ("completed", "failed", "cancelled", "expired")


def _start_server(work: Path, port: int) -> subprocess.Popen[bytes]:
    models = work / "models"
    shutil.copytree(DEMO_EMULATED, models / "emulated")
    return start_server(models, port, work / "server.log", "--data-dir", str(work / "data"))


def _metric_sum(client: httpx.Client, name: str) -> float:
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


def _busy_s(client: httpx.Client) -> float:
    return _metric_sum(client, "sluice_device_busy_seconds_total")


def _job_file(client: httpx.Client, num_items: int, tag: str = "") -> str:
    """Upload a job's input; `tag` makes its items differ from another job's, whose answers the
    result cache may hold."""
    lines = b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/embeddings",
                                 "body": {"model": "emulated", "input": f"item number {i}{tag}"}}).encode() + b"\n"
                     for i in range(num_items))
    uploaded = client.post("/v1/files", files={"file": ("job.jsonl", lines)}, data={"purpose": "batch"})
    uploaded.raise_for_status()
    return str(uploaded.json()["id"])


def _create(client: httpx.Client, file_id: str) -> str:
    batch = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/embeddings",
                                             "completion_window": "24h"})
    batch.raise_for_status()
    return str(batch.json()["id"])


def _wait(client: httpx.Client, batch_id: str, until: tuple[str, ...], poll_s: float = 0.1) -> dict:
    while True:
        batch = client.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] in until:
            return dict(batch)
        time.sleep(poll_s)


def _cpu_s(pid: int) -> float:
    """The CPU time (user + system) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_busy(client: httpx.Client, num_items: int, gateway_pid: int) -> None:
    file_id = _job_file(client, num_items)
    busy_before, cpu_before, started = _busy_s(client), _cpu_s(gateway_pid), time.monotonic()
    batch_id = _create(client, file_id)
    done = _wait(client, batch_id, FINAL)
    wall_s = time.monotonic() - started
    busy = (_busy_s(client) - busy_before) / wall_s
    cpu_ms = (_cpu_s(gateway_pid) - cpu_before) * 1000 / num_items
    counts = done["request_counts"]
    print(f"busy: {num_items} items {done['status']} in {wall_s:.1f} s ({num_items / wall_s:.0f} items/s), "
          f"{counts['completed']} ok, {counts['failed']} failed; device busy {100 * busy:.1f}%; item retries "
          f"{_metric_sum(client, 'sluice_batch_item_retries_total'):.0f}; gateway CPU {cpu_ms:.3f} ms per item")


def _bench_p99(port: int, rate: float, duration_s: float, out: Path) -> float:
    subprocess.run([sys.executable, "-m", "sluice", "bench", "--url", f"http://127.0.0.1:{port}", "--endpoint",
                    "kserve", "--model", "emulated", "--input-len", "16", "--rate", str(rate), "--duration",
                    str(duration_s), "--out", str(out), "--plot", str(out.with_suffix(".png"))],
                   check=True, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())["results"][0]
    ok = result["status_counts"]
    print(f"  {out.stem}: {result['completed_per_s']:.0f} ok/s, p50 {result['latency']['p50_ms']:.1f} ms, "
          f"p99 {result['latency']['p99_ms']:.1f} ms, outcomes {ok}")
    return float(result["latency"]["p99_ms"])


def measure_interactive(client: httpx.Client, port: int, args: argparse.Namespace, work: Path) -> None:
    alone_p99s, with_job_p99s = [], []
    for round_ in range(args.rounds):
        alone_p99s.append(_bench_p99(port, args.rate, args.duration, work / f"alone-{round_}.json"))
        batch_id = _create(client, _job_file(client, args.items, f" of round {round_}"))
        _wait(client, batch_id, ("in_progress", *FINAL), poll_s=0.02)
        with_job_p99s.append(_bench_p99(port, args.rate, args.duration, work / f"with_job-{round_}.json"))
        batch = client.get(f"/v1/batches/{batch_id}").json()
        counts = batch["request_counts"]
        print(f"  job: {batch['status']}, {counts['completed']} of {counts['total']} items done during the window")
        if batch["status"] in FINAL:
            print("  warning: the job ended before the window did; use more --items")
        else:
            client.post(f"/v1/batches/{batch_id}/cancel")
            _wait(client, batch_id, FINAL)
        alone, with_job = alone_p99s[-1], with_job_p99s[-1]
        print(f"interactive p99: alone {alone:.1f} ms, with a job {with_job:.1f} ms, ratio {with_job / alone:.3f} "
              f"(target <= 1.10)")
    if args.rounds > 1:
        alone, with_job = statistics.median(alone_p99s), statistics.median(with_job_p99s)
        print(f"median of {args.rounds} windows' p99: alone {alone:.1f} ms, with a job {with_job:.1f} ms, "
              f"ratio {with_job / alone:.3f} (target <= 1.10)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per interactive window")
    parser.add_argument("--rate", type=float, default=666.0, help="interactive requests per second")
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--phases", default="busy,interactive")
    parser.add_argument("--rounds", type=int, default=1, help="alternate the interactive windows this many times")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sluice-jobs-bench-"))
    server = _start_server(work, args.port)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; results in {work}")
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=300) as client:
            if "busy" in args.phases:
                measure_busy(client, args.items, server.pid)
            if "interactive" in args.phases:
                measure_interactive(client, args.port, args, work)
    finally:
        server.terminate()
        server.wait(60)
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

"""Canaries under load: how fast a bad version is withdrawn, and what it costs the callers; and a
whole deployment of a new version under load.

For each case, starts `sluice serve` on a copy of the demo `emulated` model with two versions
(`[routing] traffic = { 1 = 100 }`; version 2's `version.toml` makes it broken, flaky, slow or
the same as 1), offers `sluice bench` KServe load at `--rate` for `--duration` s, starts a canary
of version 2 after `--lead` s (`POST /admin/models/emulated/canary`, default steps 5/25/50%,
`--step-seconds`, `--min-requests`), polls the canary every 0.1 s, and reports when it ended
and how, and what each version answered (from `sluice_requests_total`).

    python benchmarks/canary.py                              # all cases, 400 req/s
    python benchmarks/canary.py --cases broken,flaky --duration 20

The `deploy` case starts with version 1 alone in the repository; after `--lead` s it copies
version 2 in and loads it (`POST /v2/repository/models/emulated/load`), runs the canary, and
once version 2 is promoted removes version 1's folder and loads again: what a deployment is,
with the load running throughout.

The device is the emulator (8 ms + 0.5 ms per item, 1,333 items/s): the figures are about the
control loop (evidence needed, time to decide), not any real model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from serving import start_server

from sluice.exposition import Scrape

REPO = Path(__file__).resolve().parents[1]
DEMO_EMULATED = REPO / "src" / "sluice" / "demo_models" / "emulated"
CASES = {
    "broken": "[params]\nerror_rate = 1.0\n",    # every request fails
    "flaky": "[params]\nerror_rate = 0.05\n",    # 5% of requests fail
    "slow": "[params]\nalpha_ms = 24.0\n",        # 3x the fixed cost of a batch
    "healthy": "",
    "deploy": "",  # healthy, and not in the repository when the server starts
}


def _start(work: Path, port: int, case: str) -> subprocess.Popen[bytes]:
    model = work / "models" / "emulated"
    shutil.copytree(DEMO_EMULATED, model)
    (model / "model.toml").write_text((model / "model.toml").read_text() + "\n[routing]\ntraffic = { 1 = 100 }\n")
    shutil.copytree(model / "1", model / "2")
    (model / "2" / "version.toml").write_text(CASES[case])
    if case == "deploy":
        shutil.move(model / "2", work / "staged-2")
    return start_server(work / "models", port, work / "server.log")


def _outcomes(client: httpx.Client) -> dict[tuple[str, ...], float]:
    """(version, outcome) -> requests answered so."""
    return Scrape.parse(client.get("/metrics").text, 0.0).grouped("sluice_requests_total", ("version", "outcome"))


def run_case(case: str, args: argparse.Namespace, work: Path) -> dict[str, object]:
    server = _start(work, args.port, case)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=30) as client:
            bench = threading.Thread(target=subprocess.run, args=([
                sys.executable, "-m", "sluice", "bench", "--url", f"http://127.0.0.1:{args.port}", "--endpoint",
                "kserve", "--model", "emulated", "--input-len", "16", "--rate", str(args.rate), "--duration",
                str(args.duration), "--warmup", "0", "--out", str(work / "bench.json"),
                "--plot", str(work / "bench.png")],), kwargs={"stdout": subprocess.DEVNULL, "check": True})
            bench.start()
            time.sleep(args.lead)
            started = time.monotonic()
            timeline: list[tuple[float, str, float]] = []
            if case == "deploy":
                shutil.copytree(work / "staged-2", work / "models" / "emulated" / "2")
                client.post("/v2/repository/models/emulated/load", timeout=120).raise_for_status()
                timeline.append((round(time.monotonic() - started, 2), "version 2 loaded", 0.0))
            answer = client.post("/admin/models/emulated/canary", json={
                "version": "2", "step_seconds": args.step_seconds, "min_requests": args.min_requests})
            answer.raise_for_status()
            ended_s, canary = None, answer.json()["canary"]
            while bench.is_alive():
                canary = client.get("/admin/models/emulated").json()["canary"]
                step = (canary["status"], canary["share_percent"])
                if not timeline or timeline[-1][1:] != step:
                    timeline.append((round(time.monotonic() - started, 2), *step))
                if canary["status"] != "running" and ended_s is None:
                    ended_s = time.monotonic() - started
                    if case == "deploy" and canary["status"] == "promoted":  # the old version goes
                        shutil.rmtree(work / "models" / "emulated" / "1")
                        client.post("/v2/repository/models/emulated/load", timeout=120).raise_for_status()
                        timeline.append((round(time.monotonic() - started, 2), "version 1 unloaded", 100.0))
                time.sleep(0.1)
            bench.join()
            outcomes = _outcomes(client)
    finally:
        server.terminate()
        server.wait(60)
    result = json.loads((work / "bench.json").read_text())["results"][0]
    return {
        "case": case, "status": canary["status"], "decided_after_s": None if ended_s is None else round(ended_s, 2),
        "reason": canary["reason"], "timeline": timeline,
        "v2": {outcome: count for (version, outcome), count in outcomes.items() if version == "2"},
        "v1": {outcome: count for (version, outcome), count in outcomes.items() if version == "1"},
        "client": {"p50_ms": result["latency"]["p50_ms"], "p99_ms": result["latency"]["p99_ms"],
                   "statuses": result["status_counts"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--rate", type=float, default=400.0)
    parser.add_argument("--duration", type=float, default=45.0)
    parser.add_argument("--lead", type=float, default=3.0, help="seconds of load before the canary starts")
    parser.add_argument("--step-seconds", type=float, default=10.0)
    parser.add_argument("--min-requests", type=int, default=100)
    parser.add_argument("--port", type=int, default=8767)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    results = []
    for case in args.cases.split(","):
        work = Path(tempfile.mkdtemp(prefix=f"sluice-canary-{case}-"))
        results.append(run_case(case, args, work))
        r = results[-1]
        print(f"{case}: {r['status']} after {r['decided_after_s']} s; version 2 answered {r['v2']}; "
              f"version 1 {r['v1']}; client p50/p99 {r['client']['p50_ms']:.1f}/{r['client']['p99_ms']:.1f} ms, "
              f"statuses {r['client']['statuses']}")
        print(f"  timeline {r['timeline']}")
        print(f"  {r['reason']}")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

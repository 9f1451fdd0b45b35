"""What running a response in the background costs: the same streamed answer in the foreground and
in the background, one at a time.

    python benchmarks/background_latency.py --url http://127.0.0.1:8000 [--requests 40] [--tokens 32]

Against a running `sluice serve` with the demo models (`tiny-lm`), greedy, `Cache-Control:
no-cache` (every answer generated), alternating: a foreground `POST /v1/responses` with `stream:
true`, then the same with `background: true` (stored queued, run through the app in-process, its
events kept in the store). For each: the time to the first text delta and to the stream's last
event, at the client. Prints medians and p90 of both, and their differences.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx


def _timed_stream(client: httpx.Client, body: dict[str, object]) -> tuple[float, float]:
    """(seconds to the first text delta, seconds to the last event)."""
    started = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/responses", json=body, headers={"Cache-Control": "no-cache"}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            kind = json.loads(line.removeprefix("data: "))["type"]
            if kind == "response.output_text.delta" and first is None:
                first = time.perf_counter() - started
            if kind in ("response.completed", "response.incomplete", "response.failed"):
                return first or float("nan"), time.perf_counter() - started
    raise RuntimeError("the stream ended without its last event")


def _summary(name: str, seconds: list[float]) -> str:
    ordered = sorted(seconds)
    return (f"{name:34s} median {statistics.median(ordered) * 1000:7.1f} ms   "
            f"p90 {ordered[int(0.9 * (len(ordered) - 1))] * 1000:7.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="tiny-lm")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    ask = {"model": args.model, "input": "Where is Oslo?", "max_output_tokens": args.tokens, "temperature": 0,
           "stream": True}
    runs: dict[str, list[tuple[float, float]]] = {"foreground": [], "background": []}
    with httpx.Client(base_url=args.url, timeout=120) as client:
        _timed_stream(client, ask)  # warm-up
        _timed_stream(client, {**ask, "background": True})
        for _ in range(args.requests):
            runs["foreground"].append(_timed_stream(client, ask))
            runs["background"].append(_timed_stream(client, {**ask, "background": True}))
    for name, timings in runs.items():
        print(_summary(f"{name}: first text", [t[0] for t in timings]))
        print(_summary(f"{name}: whole answer", [t[1] for t in timings]))
    for index, what in ((0, "first text"), (1, "whole answer")):
        differences = [b[index] - f[index] for f, b in zip(runs["foreground"], runs["background"], strict=True)]
        print(f"background - foreground, {what}: median {statistics.median(differences) * 1000:+.1f} ms (pairs)")


if __name__ == "__main__":
    main()

"""Prefix affinity across two workers: conversations that share long system prompts, routed with
and without it.

    PYTHONPATH=src python benchmarks/prefix_routing.py [--rate 4] [--duration 40] [--conversations 40] [--json out.json]

One `sluice serve --workers 2` of tiny-lm (generated here; 48 MiB = 8,192 tokens of KV per worker),
started once with `--prefix-affinity` and once with `--no-prefix-affinity`. The same open-loop load
in both: Poisson arrivals at `--rate` requests/s for `--duration` s, each a streamed completion of
16 tokens whose prompt is one of `--conversations` system prompts (~560 characters each, drawn
uniformly) followed by a short question. Reported: the share of prompt tokens the workers found
cached (`usage.prompt_tokens_details.cached_tokens`), TTFT and end-to-end percentiles, and how
many requests the gateway routed by prefix (`sluice_prefix_routed_requests_total`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import openai

sys.path.insert(0, str(Path(__file__).parent))
from serving import start_server

from sluice.engines.generative.tiny import make_tiny_lm
from sluice.exposition import Scrape
from sluice.repository import MANIFEST, write_manifest


def _repository(folder: Path) -> Path:
    version = make_tiny_lm(folder / "tiny" / "1")
    write_manifest(version, version / MANIFEST)
    (folder / "tiny" / "model.toml").write_text('kind = "generative"\n[slo]\ndefault_ms = 60000\n[params]\n'
                                                'kv_cache_mb = 48\nmax_num_seqs = 32\nnum_threads = 1\n')
    return folder


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def _load(url: str, rate: float, duration_s: float, conversations: int, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    systems = [f"You are assistant number {i}. " + "Answer briefly and politely, in plain words, and "
               "never invent facts you were not given. " * 6 for i in range(conversations)]
    arrivals = np.cumsum(rng.exponential(1.0 / rate, int(rate * duration_s * 1.5)))
    arrivals = arrivals[arrivals < duration_s]
    picks = rng.integers(0, conversations, len(arrivals))
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300,
                                default_headers={"Cache-Control": "no-cache"})
    ttfts: list[float] = []
    e2es: list[float] = []
    prompt_tokens = cached_tokens = 0

    async def one(i: int, at: float, start: float) -> None:
        nonlocal prompt_tokens, cached_tokens
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        sent = time.perf_counter()
        first = None
        stream = await client.completions.create(
            model="tiny", prompt=f"{systems[picks[i]]}Question {i}: what next?", max_tokens=16, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if first is None and chunk.choices:
                first = time.perf_counter()
            if chunk.usage is not None:
                prompt_tokens += chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                cached_tokens += details.cached_tokens if details is not None and details.cached_tokens else 0
        ttfts.append((first or time.perf_counter()) - sent)
        e2es.append(time.perf_counter() - sent)

    start = time.perf_counter()
    await asyncio.gather(*(one(i, float(at), start) for i, at in enumerate(arrivals)))
    await client.close()
    return {"requests": len(arrivals), "cached_share": cached_tokens / max(prompt_tokens, 1),
            "ttft_p50_s": _percentile(ttfts, 50), "ttft_p99_s": _percentile(ttfts, 99),
            "e2e_p50_s": _percentile(e2es, 50), "e2e_p99_s": _percentile(e2es, 99),
            "ttft_mean_s": statistics.fmean(ttfts)}


def _routed(url: str) -> dict[str, float]:
    scrape = Scrape.parse(httpx.get(f"{url}/metrics").text, 0.0)
    return {by: count for (by,), count in scrape.grouped("sluice_prefix_routed_requests_total", ("by",)).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--conversations", type=int, default=40)
    parser.add_argument("--port", type=int, default=8793)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results: dict[str, object] = {"rate": args.rate, "duration_s": args.duration, "conversations": args.conversations}
    with tempfile.TemporaryDirectory() as tmp:
        repo = _repository(Path(tmp) / "models")
        for mode in ("--prefix-affinity", "--no-prefix-affinity"):
            server = start_server(repo, args.port, Path(tmp) / f"server{mode}.log", "--workers", "2", mode)
            try:
                url = f"http://127.0.0.1:{args.port}"
                asyncio.run(_load(url, 1.0, 3.0, args.conversations, args.seed + 1))  # warm-up, not counted
                before = _routed(url)
                measured = asyncio.run(_load(url, args.rate, args.duration, args.conversations, args.seed))
                after = _routed(url)
                measured |= {f"routed_by_{by}": after.get(by, 0.0) - before.get(by, 0.0) for by in ("prefix", "load")}
            finally:
                server.terminate()
                server.wait(timeout=60)
            results[mode.strip("-")] = measured
            print(mode.strip("-"), json.dumps(measured), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

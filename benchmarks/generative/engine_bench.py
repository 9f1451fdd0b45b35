"""Generative engine benchmark on tiny-lm, CPU: decode-step breakdown and continuous vs static batching.

    PYTHONPATH=src python benchmarks/generative/engine_bench.py [--requests 64] [--batch 32] [--json out.json]
    PYTHONPATH=src python benchmarks/generative/engine_bench.py --breakdown-only --logprobs 0 5 20

    PYTHONPATH=src python benchmarks/generative/engine_bench.py --choices 4
    PYTHONPATH=src python benchmarks/generative/engine_bench.py --structured

--structured: the decode breakdown with every sequence's output held to a JSON schema (an array
of at least 100 objects, so none completes while measured) and with none, alternating --rounds
times: what computing each step's allowed tokens and masking the logits adds.

--choices N: N choices of one 256-token prompt (32 tokens each, greedy) alone on the engine,
with the choices sharing the first one's prompt blocks (what the worker does for `n`) and with
each computing the prompt itself, alternating --rounds times: wall time and prompt tokens computed.

--logprobs K...: the decode breakdown is also taken with every sequence asking for its tokens'
log-probabilities and K alternatives (a run without them comes first, and the runs alternate
--rounds times, so the difference is measured on the same engine and host conditions).

(a) 32 sequences in steady decode: median per-step time of each phase (schedule, prepare inputs,
    forward, sample, output processing) and the share of the step outside the forward pass.
(b) The same request set (prompts 32-256 tokens, outputs 16-128, fixed seed, all offered at t=0)
    run two ways on the same engine and model:
      continuous  all requests queued; up to --batch run at once, joining and leaving every step
      static      request-level batches of --batch: a batch starts when the previous one is done and
                  runs until its longest request is done (every row decodes to the batch's longest
                  output, as a padded `generate()` batch does); only requested tokens count
      static_padded_prompts  the same, with prompts also left-padded to the batch's longest, as
                  `generate()` on a padded batch computes them
    Output tokens/s and TTFT percentiles (from t=0 to a request's first token) of both.

--online RATE: the same request mix arriving over time instead (Poisson, RATE requests/s for
--duration s), each mode on its own engine with the same KV memory (--kv-tokens) and context cap
(--max-model-len), as the server's model folders configure them:
      continuous        paged KV, blocks taken as tokens are computed; joins and leaves every step
      static            request-level batching, each member reserving --max-model-len tokens of KV
      static-maxtokens  the same, reserving prompt + max_tokens (the kindest static baseline)
    Output tokens/s = output tokens / (first arrival .. last token), TTFT from each request's
    arrival (a request with no token when a mode's --cap-s runs out counts as slower than any),
    TPOT per request. --device cuda --dtype bfloat16 --model 1b runs it on a GPU with a ~1 B
    parameter random-weight Llama (hidden 2048, 16 layers, GQA 16/4 heads of 128, SwiGLU 5632):

    PYTHONPATH=src python benchmarks/generative/engine_bench.py --online 150 --duration 6 \
        --device cuda --dtype bfloat16 --model 1b --kv-tokens 16384 --json out.json

--beside-job RATE: interactive requests (Poisson, RATE/s for --duration s, prompts 32-256 tokens,
outputs 16-64) on a continuous engine with --kv-tokens of KV, alone and then beside a batch job
(--job-size batch-class requests, prompts 32-256, outputs 16-128, all queued at t=0, as the
executor feeds a job's items): the interactive TTFT p50/p99 of both and the job's output
tokens/s meanwhile. Run it with PYTHONPATH set to two checkouts to compare schedulers.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sluice import wire
from sluice.engines.generative import EngineConfig, LLMEngine, SamplingParams
from sluice.engines.generative.tiny import make_tiny_lm
from sluice.priority import Priority


def request_set(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(4, vocab) for _ in range(rng.randint(32, 256))], rng.randint(16, 128)) for _ in range(n)]


def engine_for(model_dir: Path, batch: int) -> LLMEngine:
    config = EngineConfig(block_size=16, max_num_seqs=batch, max_num_batched_tokens=2048,
                          long_prefill_token_threshold=512, kv_cache_bytes=512 * 1024 * 1024)
    return LLMEngine(model_dir, config)


STRUCTURED_SCHEMA = {"type": "array", "minItems": 100, "items": {
    "type": "object", "required": ["name", "count", "ok"], "additionalProperties": False,
    "properties": {"name": {"type": "string", "maxLength": 12}, "count": {"type": "integer"},
                   "ok": {"type": "boolean"}}}}
"""A JSON schema no sequence completes within the measured steps (at least 100 objects)."""


def start_decoding(engine: LLMEngine, num_seqs: int, logprobs: int | None = None, structured: bool = False) -> None:
    """`num_seqs` sequences (64-token prompts, up to 900 tokens each: within 1,024) prefilled and in
    steady decode, every one of them in the step just taken."""
    params = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True, logprobs=logprobs)
    output_format = wire.OutputFormat("json_schema", json.dumps(STRUCTURED_SCHEMA))
    for i, (prompt, _) in enumerate(request_set(num_seqs, engine.spec.vocab_size, seed=1)):
        assert engine.grammars is not None
        engine.add_request(f"d{i}", prompt[:64], params,
                           matcher=engine.grammars.matcher(output_format) if structured else None)
    while engine.stats().last_step is None or engine.stats().last_step.num_batched_tokens != num_seqs:
        engine.step()


def decode_breakdown(model_dir: Path, num_seqs: int = 32, num_steps: int = 40, logprobs: int | None = None,
                     structured: bool = False) -> dict[str, float]:
    engine = engine_for(model_dir, num_seqs)
    start_decoding(engine, num_seqs, logprobs, structured)
    phases: dict[str, list[float]] = {k: [] for k in ("schedule", "prepare", "forward", "sample", "output", "total")}
    for _ in range(num_steps):
        engine.step()
        t = engine.stats().last_step
        assert t is not None and t.num_seqs == num_seqs
        for name in ("schedule", "prepare", "forward", "sample", "output"):
            phases[name].append(getattr(t, f"{name}_s"))
        phases["total"].append(t.total_s)
    result = {f"{k}_ms": statistics.median(v) * 1e3 for k, v in phases.items()}
    overhead = [total - fwd for total, fwd in zip(phases["total"], phases["forward"], strict=True)]
    result["overhead_pct"] = 100 * statistics.median(o / t for o, t in zip(overhead, phases["total"], strict=True))
    return result


def logprobs_cost(model_dir: Path, ks: list[int], rounds: int) -> dict[str, dict[str, float]]:
    """The decode breakdown without log-probabilities and with each K, alternating, `rounds` times:
    the median over rounds of each phase's median."""
    settings: list[int | None] = [None, *ks]
    taken: dict[str, list[dict[str, float]]] = {_label(k): [] for k in settings}
    for _ in range(rounds):
        for k in settings:
            taken[_label(k)].append(decode_breakdown(model_dir, logprobs=k))
    return {label: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            for label, runs in taken.items()}


def choices_cost(model_dir: Path, n: int, rounds: int) -> dict[str, dict[str, float]]:
    """`n` greedy choices of one 256-token prompt, sharing its blocks or each computing it."""
    engine = engine_for(model_dir, 32)
    prompt = request_set(1, engine.spec.vocab_size, seed=3)[0][0]
    prompt = (prompt * 8)[:256]
    taken: dict[str, list[tuple[float, int]]] = {"shared": [], "each computes": []}
    for r in range(rounds):
        for label in taken:
            salt = f"{label}-{r}"  # nothing cached from an earlier run
            start = time.perf_counter()
            for i in range(n):
                prefix_of = "c0" if i and label == "shared" else None
                engine.add_request(f"c{i}", prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True),
                                   salt=salt, prefix_of=prefix_of)
            computed = 0
            while engine.has_unfinished():
                engine.step()
                computed += sum(engine.last_step_tokens.values())
            taken[label].append((time.perf_counter() - start, computed - n * 31))  # less the decodes
    return {label: {"wall_s": statistics.median(t for t, _ in runs), "prompt_tokens_computed": runs[0][1]}
            for label, runs in taken.items()}


def structured_cost(model_dir: Path, rounds: int) -> dict[str, dict[str, float]]:
    """The decode breakdown with every sequence's output constrained by a JSON schema and with
    none, alternating, `rounds` times: the median over rounds of each phase's median."""
    taken: dict[str, list[dict[str, float]]] = {"unconstrained": [], "json schema": []}
    for _ in range(rounds):
        for label in taken:
            taken[label].append(decode_breakdown(model_dir, structured=label == "json schema"))
    return {label: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            for label, runs in taken.items()}


def _label(k: int | None) -> str:
    return "no logprobs" if k is None else f"logprobs={k}"


def _run(engine: LLMEngine, requests: list[tuple[int, list[int], int]], t0: float,
         first_token: dict[int, float], counted: dict[int, int]) -> None:
    for i, prompt, max_tokens in requests:
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                first_token.setdefault(int(out.request_id), time.perf_counter() - t0)


def throughput(model_dir: Path, num_requests: int, batch: int, static: bool, pad_prompts: bool = False
               ) -> dict[str, float]:
    engine = engine_for(model_dir, batch)
    reqs = request_set(num_requests, engine.spec.vocab_size)
    first_token: dict[int, float] = {}
    counted: dict[int, int] = {}
    t0 = time.perf_counter()
    if static:
        for start in range(0, num_requests, batch):
            group = reqs[start:start + batch]
            longest = max(out for _, out in group)
            width = max(len(p) for p, _ in group)
            padded = [([0] * (width - len(p)) + p) if pad_prompts else p for p, _ in group]
            _run(engine, [(start + j, p, longest) for j, p in enumerate(padded)], t0, first_token, counted)
    else:
        _run(engine, [(i, p, out) for i, (p, out) in enumerate(reqs)], t0, first_token, counted)
    elapsed = time.perf_counter() - t0
    useful = sum(out for _, out in reqs)
    ttft = sorted(first_token.values())
    return {"elapsed_s": elapsed, "output_tokens": useful, "output_tokens_per_s": useful / elapsed,
            "ttft_p50_s": ttft[len(ttft) // 2], "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "preemptions": engine.stats().num_preemptions_total}


MODELS = {
    "tiny": {},
    "1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 16,
           "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 2048,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
}
ONLINE_MODES = {"continuous": ("continuous", "max_model_len"), "static": ("static", "max_model_len"),
                "static-maxtokens": ("static", "max_tokens")}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def poisson_arrivals(rate: float, duration: float, seed: int) -> list[float]:
    """Arrival times (s) of a Poisson process of `rate`/s over `duration` s."""
    rng = random.Random(seed)
    arrivals: list[float] = []
    t = rng.expovariate(rate)
    while t < duration:
        arrivals.append(t)
        t += rng.expovariate(rate)
    return arrivals


def online(model_dir: Path, mode: str, rate: float, duration: float, kv_tokens: int, max_model_len: int,
           device: str, dtype: str, cap_s: float, seed: int = 0, cuda_graphs: bool = True) -> dict[str, float]:
    """One mode at an online load: Poisson arrivals, the engine stepped as fast as it goes."""
    scheduling, reserve = ONLINE_MODES[mode]
    engine = LLMEngine(model_dir, EngineConfig(
        block_size=16, num_kv_blocks=kv_tokens // 16, max_num_seqs=256, max_num_batched_tokens=2048,
        long_prefill_token_threshold=512, device=device, dtype=dtype, max_model_len=max_model_len,
        scheduling=scheduling, static_reserve=reserve, cuda_graphs=cuda_graphs))
    for i, (prompt, _) in enumerate(request_set(4, engine.spec.vocab_size, seed + 1)):  # warm-up
        engine.add_request(f"w{i}", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    arrivals = poisson_arrivals(rate, duration, seed)
    reqs = request_set(len(arrivals), engine.spec.vocab_size, seed)
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    tokens = 0
    last_token = 0.0
    running: list[int] = []
    nxt = 0
    t0 = time.perf_counter()
    while True:
        now = time.perf_counter() - t0
        if now > cap_s:
            break
        while nxt < len(arrivals) and arrivals[nxt] <= now:
            prompt, max_tokens = reqs[nxt]
            engine.add_request(str(nxt), prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
            nxt += 1
        if engine.has_unfinished():
            outputs = engine.step()
            now = time.perf_counter() - t0
            running.append(engine.stats().num_running)
            for out in outputs:
                i = int(out.request_id)
                if out.new_token_ids:
                    first.setdefault(i, now)
                    tokens += len(out.new_token_ids)
                    last_token = now
                if out.is_finished:
                    done[i] = now
        elif nxt < len(arrivals):
            time.sleep(max(0.0, arrivals[nxt] - now))
        else:
            break
    ttft = [first.get(i, float("inf")) - arrivals[i] for i in range(len(arrivals))]
    tpot = [(done[i] - first[i]) / (reqs[i][1] - 1) for i in done if reqs[i][1] > 1]
    return {"requests": len(arrivals), "completed": len(done), "output_tokens": tokens,
            "output_tokens_per_s": tokens / last_token if last_token else 0.0,
            "ttft_p50_s": _percentile(ttft, 0.5), "ttft_p99_s": _percentile(ttft, 0.99),
            "tpot_median_ms": 1000 * statistics.median(tpot) if tpot else float("nan"),
            "running_seqs_median": statistics.median(running) if running else 0.0,
            "preemptions": engine.stats().num_preemptions_total}


def beside_job(model_dir: Path, rate: float, duration: float, job_size: int, kv_tokens: int, max_model_len: int,
               seed: int = 0) -> dict[str, dict[str, float]]:
    """Interactive TTFT alone and beside a batch job (see the module's docstring)."""
    arrivals = poisson_arrivals(rate, duration, seed)
    results = {}
    for label, num_job in (("alone", 0), ("beside a job", job_size)):
        engine = LLMEngine(model_dir, EngineConfig(
            block_size=16, num_kv_blocks=kv_tokens // 16, max_num_seqs=256, max_num_batched_tokens=2048,
            long_prefill_token_threshold=512, max_model_len=max_model_len))
        vocab = engine.spec.vocab_size
        chats = [(p, min(out, 64)) for p, out in request_set(len(arrivals), vocab, seed)]
        for i, (prompt, max_tokens) in enumerate(request_set(num_job, vocab, seed + 7)):
            engine.add_request(f"job{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                               priority=Priority.BATCH)
        first: dict[int, float] = {}
        job_tokens = 0
        nxt = 0
        t0 = time.perf_counter()
        while nxt < len(arrivals) or len(first) < len(arrivals):
            now = time.perf_counter() - t0
            while nxt < len(arrivals) and arrivals[nxt] <= now:
                prompt, max_tokens = chats[nxt]
                engine.add_request(str(nxt), prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                    ignore_eos=True), priority=Priority.INTERACTIVE)
                nxt += 1
            if not engine.has_unfinished():
                time.sleep(max(0.0, arrivals[nxt] - now))
                continue
            for out in engine.step():
                if out.request_id.startswith("job"):
                    job_tokens += len(out.new_token_ids)
                elif out.new_token_ids:
                    first.setdefault(int(out.request_id), time.perf_counter() - t0)
        elapsed = time.perf_counter() - t0
        ttft = [first[i] - arrivals[i] for i in range(len(arrivals))]
        results[label] = {"interactive": len(arrivals), "ttft_p50_s": _percentile(ttft, 0.5),
                          "ttft_p99_s": _percentile(ttft, 0.99), "ttft_max_s": max(ttft),
                          "job_output_tokens_per_s": job_tokens / elapsed,
                          "preemptions": engine.stats().num_preemptions_total}
        print(label, json.dumps(results[label]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--logprobs", type=int, nargs="*", default=[], metavar="K")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--breakdown-only", action="store_true")
    parser.add_argument("--choices", type=int, default=0, metavar="N")
    parser.add_argument("--structured", action="store_true", help="the decode step with JSON-schema outputs")
    parser.add_argument("--online", type=float, default=0.0, metavar="RATE", help="requests/s, Poisson arrivals")
    parser.add_argument("--duration", type=float, default=10.0, help="--online: seconds of arrivals")
    parser.add_argument("--beside-job", type=float, default=0.0, metavar="RATE",
                        help="interactive requests/s alone and beside a batch job")
    parser.add_argument("--job-size", type=int, default=400, help="--beside-job: the job's requests")
    parser.add_argument("--modes", nargs="+", default=list(ONLINE_MODES), choices=list(ONLINE_MODES))
    parser.add_argument("--cap-s", type=float, default=120.0, help="--online: wall-time limit of one mode")
    parser.add_argument("--kv-tokens", type=int, default=8192, help="--online: KV cache size in tokens")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--model", choices=list(MODELS), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="--online on CUDA: decode steps replay CUDA graphs (the default; --no-cuda-graphs: eager)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_lm(Path(tmp) / "tiny-lm", **MODELS[args.model])
        if args.beside_job:
            results = {"rate": args.beside_job, "duration_s": args.duration, "job_size": args.job_size,
                       "kv_tokens": args.kv_tokens, **beside_job(model_dir, args.beside_job, args.duration,
                                                                 args.job_size, args.kv_tokens, args.max_model_len)}
            if args.json:
                args.json.write_text(json.dumps(results, indent=2) + "\n")
            return
        if args.online:
            results = {"rate": args.online, "duration_s": args.duration, "kv_tokens": args.kv_tokens,
                       "max_model_len": args.max_model_len, "model": args.model, "device": args.device,
                       "cuda_graphs": args.cuda_graphs}
            if args.device == "cuda":
                results["gpu"] = torch.cuda.get_device_name()
            for mode in args.modes:
                results[mode] = online(model_dir, mode, args.online, args.duration, args.kv_tokens,
                                       args.max_model_len, args.device, args.dtype, args.cap_s,
                                       cuda_graphs=args.cuda_graphs)
                print(mode, json.dumps(results[mode]), flush=True)
            for mode in args.modes[1:]:
                ratio = results[args.modes[0]]["output_tokens_per_s"] / results[mode]["output_tokens_per_s"]
                print(f"{args.modes[0]} / {mode} output tokens/s: {ratio:.2f}x")
            if args.json:
                args.json.write_text(json.dumps(results, indent=2) + "\n")
            return
        if args.structured:
            results = structured_cost(model_dir, args.rounds)
            print("decode step at 32 seqs, structured or not:", json.dumps(results, indent=1))
            return
        if args.choices:
            results = choices_cost(model_dir, args.choices, args.rounds)
            print(f"{args.choices} choices of one prompt:", json.dumps(results, indent=1))
            return
        if args.logprobs:
            results = logprobs_cost(model_dir, args.logprobs, args.rounds)
            print("decode step at 32 seqs with log-probabilities:", json.dumps(results, indent=1))
            if args.json:
                args.json.write_text(json.dumps(results, indent=2) + "\n")
            return
        results = {"decode_breakdown_32": decode_breakdown(model_dir)}
        print("decode step at 32 seqs (median ms):", json.dumps(results["decode_breakdown_32"], indent=1))
        if args.breakdown_only:
            return
        runs = (("continuous", False, False), ("static", True, False), ("static_padded_prompts", True, True))
        for name, static, pad in runs:
            results[name] = throughput(model_dir, args.requests, args.batch, static, pad)
            print(name, json.dumps(results[name], indent=1))
    for name in ("static", "static_padded_prompts"):
        ratio = results["continuous"]["output_tokens_per_s"] / results[name]["output_tokens_per_s"]
        results[f"speedup_vs_{name}"] = ratio
        print(f"continuous / {name} output tokens/s: {ratio:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Where a decode step's time goes: host work, kernel launches, or the device's own work.

    PYTHONPATH=src python benchmarks/generative/step_profile.py --device cuda --dtype bfloat16 --model 1b

1. The cost of one kernel launch on this machine (2,000 in-place adds of a 1-element tensor).
2. --seqs sequences (64-token prompts) in steady decode: the median wall time of a step with the
   device synchronised before and after it, beside the engine's own (unsynchronised) phase timings.
3. torch.profiler over --profile-steps such steps: the ops that take the most host time, how many
   kernels a step launches, and how long the device itself was busy per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from engine_bench import MODELS, start_decoding

from sluice.engines.generative import EngineConfig, LLMEngine
from sluice.engines.generative.tiny import make_tiny_lm


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def launch_cost_us(device: str, launches: int = 2000) -> float:
    x = torch.zeros(1, device=device)
    for _ in range(100):
        x.add_(1)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(launches):
        x.add_(1)
    _sync(device)
    return (time.perf_counter() - t0) / launches * 1e6


def decode_engine(model_dir: Path, seqs: int, device: str, dtype: str, cuda_graphs: bool = True) -> LLMEngine:
    engine = LLMEngine(model_dir, EngineConfig(block_size=16, max_num_seqs=seqs, num_kv_blocks=seqs * 64,
                                               device=device, dtype=dtype, max_model_len=1024,
                                               cuda_graphs=cuda_graphs))
    start_decoding(engine, seqs)
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", choices=list(MODELS), default="tiny")
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="decode steps replay CUDA graphs (the engine's default; --no-cuda-graphs: eager)")
    args = parser.parse_args()
    print(f"one kernel launch: {launch_cost_us(args.device):.1f} us", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        engine = decode_engine(make_tiny_lm(Path(tmp) / "m", **MODELS[args.model]), args.seqs, args.device,
                               args.dtype, args.cuda_graphs)
        walls: list[float] = []
        phases: dict[str, list[float]] = {k: [] for k in ("schedule", "prepare", "forward", "sample", "output")}
        for _ in range(args.steps):
            _sync(args.device)
            t0 = time.perf_counter()
            engine.step()
            _sync(args.device)
            walls.append(time.perf_counter() - t0)
            timing = engine.stats().last_step
            assert timing is not None
            for name in phases:
                phases[name].append(getattr(timing, f"{name}_s"))
        summary = {"step_ms": 1e3 * statistics.median(walls)} | {
            f"{k}_ms": 1e3 * statistics.median(v) for k, v in phases.items()}
        print(f"decode step at {args.seqs} seqs (median, synchronised):", json.dumps(summary), flush=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.profile_steps):
                engine.step()
            _sync(args.device)
        events = prof.key_averages()
        print(events.table(sort_by="self_cpu_time_total", row_limit=25))
        launch_calls = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")
        launches = sum(e.count for e in events if e.key in launch_calls)
        device_us = sum(e.self_device_time_total for e in events)
        print(f"per step: {launches / args.profile_steps:.0f} kernel launches, "
              f"device busy {device_us / args.profile_steps / 1e3:.2f} ms")


if __name__ == "__main__":
    main()

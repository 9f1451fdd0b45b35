"""The static (request-level) batching baseline: batch barrier, KV reserved up front, no preemption,
and the same greedy tokens as the continuous engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.engines.generative import EngineConfig, LLMEngine, SamplingParams
from sluice.engines.generative.block_manager import BlockManager
from sluice.engines.generative.scheduler import SchedulerConfig
from sluice.engines.generative.sequence import FinishReason, Sequence
from sluice.engines.generative.static_scheduler import StaticScheduler


def _scheduler(num_blocks: int = 32, block_size: int = 4, max_num_seqs: int = 8, budget: int = 64,
               max_model_len: int = 32, reserve_max_model_len: bool = True) -> StaticScheduler:
    return StaticScheduler(SchedulerConfig(max_num_seqs, budget, 16), BlockManager(num_blocks, block_size),
                           max_model_len, reserve_max_model_len)


def _seq(rid: str, n: int, max_tokens: int = 8, arrival: float = 0.0) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), arrival)


def _step(s: StaticScheduler):
    out = s.schedule(0.0)
    s.update(out, {c.request_id: 7 for c in out.chunks if c.needs_sample})
    return out


def test_memory_bounds_the_batch_and_nobody_joins_until_it_is_done() -> None:
    # 32 blocks of 4 = 128 tokens; each sequence reserves max_model_len = 32 tokens: 4 fit.
    s = _scheduler()
    for i in range(6):
        s.add(_seq(f"r{i}", 5, arrival=i))
    _step(s)
    assert [q.request_id for q in s.running] == ["r0", "r1", "r2", "r3"]
    assert s.blocks.num_free_blocks == 0
    s.finish(s.running[0], FinishReason.LENGTH)  # one member done: its blocks free, but the batch is closed
    for _ in range(3):
        out = _step(s)
        assert {c.request_id for c in out.chunks} == {"r1", "r2", "r3"}
    for seq in list(s.running):
        s.finish(seq, FinishReason.LENGTH)
    out = _step(s)
    assert {c.request_id for c in out.chunks} == {"r4", "r5"}
    assert s.num_preemptions_total == 0


def test_max_tokens_reserve_fits_more_sequences() -> None:
    s = _scheduler(reserve_max_model_len=False)
    for i in range(10):
        s.add(_seq(f"r{i}", 5, max_tokens=3, arrival=i))  # 8 tokens = 2 blocks each
    _step(s)
    assert len(s.running) == 8  # the sequence cap, not memory, binds here


def test_a_batch_larger_than_the_token_budget_prefills_over_several_steps() -> None:
    s = _scheduler(budget=8)
    for i in range(3):
        s.add(_seq(f"r{i}", 6, arrival=i))
    first = _step(s)
    assert len(s.running) == 3 and first.num_batched_tokens == 8
    second = _step(s)
    assert second.num_batched_tokens <= 8 and all(len(c.token_ids) > 0 for c in second.chunks)


def test_static_engine_gives_the_continuous_engines_greedy_tokens(llama_dir: Path) -> None:
    prompts = [[1 + (7 * i + j) % 300 for j in range(10 + 9 * i)] for i in range(5)]
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0) for i in range(5)]
    results = {}
    for scheduling in ("continuous", "static"):
        engine = LLMEngine(llama_dir, EngineConfig(num_kv_blocks=64, block_size=8, max_model_len=128,
                                                   scheduling=scheduling))
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"r{i}", prompt, p)
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(5)}
        max_running = 0
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            max_running = max(max_running, engine.stats().num_running)
        results[scheduling] = (tokens, max_running)
    assert results["static"][0] == results["continuous"][0]
    assert results["static"][1] == 4  # 64 blocks of 8 / 128 reserved tokens
    assert results["continuous"][1] == 5


def test_static_config_is_checked() -> None:
    with pytest.raises(ValueError, match="scheduling"):
        EngineConfig(scheduling="dynamic")
    with pytest.raises(ValueError, match="static_reserve"):
        EngineConfig(static_reserve="all")


def test_a_reservation_larger_than_the_cache_is_refused(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="reserves max_model_len"):
        LLMEngine(llama_dir, EngineConfig(num_kv_blocks=4, block_size=8, max_model_len=128, scheduling="static"))

"""The engine's main promise: greedy output equals transformers' `generate()` token for token."""

from __future__ import annotations

from sluice.engines.generative import EngineConfig, LLMEngine
from tests.engines.generative.conftest import (
    check_batch,
    check_batched_prefix_hits_and_preemptions,
    greedy,
    prompts,
    run_to_completion,
)


def test_single_request_matches_transformers(model_dir, hf_greedy):
    engine = LLMEngine(model_dir, EngineConfig(block_size=8, num_kv_blocks=64))
    prompt = prompts(0, 1, 20, 20)[0]
    engine.add_request("a", prompt, greedy(24))
    assert run_to_completion(engine)["a"] == hf_greedy(model_dir, prompt, 24)


def test_batched_requests_joining_at_different_steps(model_dir, hf_greedy):
    engine = LLMEngine(model_dir, EngineConfig(block_size=8, num_kv_blocks=256))
    batch = prompts(1, 8, 3, 60)
    check_batch(engine, model_dir, hf_greedy, batch, [5 + 3 * i for i in range(8)], join_every=2)
    assert engine.stats().kv_cache_usage == 0.0


def test_decodes_of_very_different_lengths_are_attended_in_groups_of_similar_length(llama_dir):
    """On the CPU a decode group reads its longest context's worth of slots for every member, so
    contexts of 4 and 101 tokens go in separate groups (the batched tests above check the output)."""
    from sluice.engines.generative.scheduler import ScheduledChunk, SchedulerOutput

    engine = LLMEngine(llama_dir, EngineConfig(block_size=8, num_kv_blocks=256))
    starts = [3, 100, 4, 40, 41]
    chunks = tuple(ScheduledChunk(str(i), (5,), start, tuple(range(start // 8 + 1)), True)
                   for i, start in enumerate(starts))
    groups = engine._runner.prepare(SchedulerOutput(chunks, (), 0)).forward.groups
    assert sorted((g.num_seqs, g.slots.shape[1]) for g in groups) == [(1, 101), (2, 5), (2, 42)]
    assert sorted(row for g in groups for row in g.token_index.tolist()) == list(range(len(starts)))

    def one_group(starts: list[int]) -> bool:
        chunks = tuple(ScheduledChunk(str(i), (5,), start, (0, 1), True) for i, start in enumerate(starts))
        (group,) = engine._runner.prepare(SchedulerOutput(chunks, (), 0)).forward.groups
        return group.covers_all

    assert one_group([10, 10, 11]) and not one_group([11, 10, 10])  # in place only when rows are in group order

    fresh = ScheduledChunk("new", (5,) * 12, 0, (0, 1), True)  # a prompt's first chunk
    later = ScheduledChunk("old", (5,) * 4, 16, (0, 1, 2), True)  # a continuation (or a cached prefix)
    groups = engine._runner.prepare(SchedulerOutput((fresh, later), (), 0)).forward.groups
    assert [g.fresh_rows for g in groups] == [(0, 12), None]  # the first attends to itself: no gather


def test_pure_decode_steps_of_requests_that_start_together_match_transformers(model_dir, hf_greedy):
    """Equal prompts added at once decode in one group in row order, attended in place."""
    engine = LLMEngine(model_dir, EngineConfig(block_size=8, num_kv_blocks=256))
    batch = prompts(9, 4, 12, 12)
    for i, prompt in enumerate(batch):
        engine.add_request(f"r{i}", prompt, greedy(16))
    outputs = run_to_completion(engine)
    assert [outputs[f"r{i}"] for i in range(4)] == [hf_greedy(model_dir, p, 16) for p in batch]


def test_chunked_prefill_with_small_token_budget(model_dir, hf_greedy):
    config = EngineConfig(block_size=8, num_kv_blocks=256, max_num_batched_tokens=24, long_prefill_token_threshold=16)
    engine = LLMEngine(model_dir, config)
    batch = prompts(2, 4, 40, 90)
    check_batch(engine, model_dir, hf_greedy, batch, [12] * 4, join_every=3)
    assert engine.stats().last_step.num_batched_tokens <= 24


def test_prefix_cache_hits_do_not_change_output(model_dir, hf_greedy):
    engine = LLMEngine(model_dir, EngineConfig(block_size=8, num_kv_blocks=256))
    shared = prompts(3, 1, 40, 40)[0]
    tails = prompts(4, 4, 1, 12)
    batch = [shared + t for t in tails] + [shared]  # the last one is entirely a cached prefix
    check_batch(engine, model_dir, hf_greedy, batch, [10] * 5, join_every=4)
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens >= 4 * 40 - 8  # every later request reused the shared blocks


def test_preemption_by_recompute_keeps_output_exact(model_dir, hf_greedy):
    # 12 blocks of 8 = 96 tokens of KV for 6 requests needing ~50 each: they must be preempted
    engine = LLMEngine(model_dir, EngineConfig(block_size=8, num_kv_blocks=12))
    batch = prompts(5, 6, 10, 30)
    check_batch(engine, model_dir, hf_greedy, batch, [30] * 6, join_every=1)
    stats = engine.stats()
    assert stats.num_preemptions_total > 0
    assert stats.kv_cache_usage == 0.0


def test_llama3_rope_scaling_matches_transformers(llama3_rope_dir, hf_greedy):
    engine = LLMEngine(llama3_rope_dir, EngineConfig(block_size=8, num_kv_blocks=256))
    assert engine.spec.rope_scaling is not None
    batch = prompts(6, 3, 20, 140)  # positions past the original 64-token context
    check_batch(engine, llama3_rope_dir, hf_greedy, batch, [24] * 3, join_every=2)


def test_sliding_window_attention_matches_transformers(windowed_dir, hf_greedy):
    """Prompts of 20-60 tokens and 30 more generated, batched, through prefix-cache hits: each
    windowed layer sees only its last 16 positions, as transformers computes them."""
    engine = LLMEngine(windowed_dir, EngineConfig(block_size=8, num_kv_blocks=256))
    assert engine.spec.sliding_window == 16 and engine.max_model_len == 512
    assert engine.spec.windowed_layers == ({0, 1} if "mistral" in windowed_dir.name else {1})
    batch = prompts(8, 4, 20, 60)
    check_batch(engine, windowed_dir, hf_greedy, [*batch, batch[0] + batch[1][:9]], [30] * 5, join_every=2)
    assert engine.stats().prefix_cache_hit_tokens > 0


def test_qwen3_matches_transformers_batched_with_prefix_hits_and_preemptions(qwen3_dir, hf_greedy):
    engine, _ = check_batched_prefix_hits_and_preemptions(
        lambda blocks: LLMEngine(qwen3_dir, EngineConfig(block_size=8, num_kv_blocks=blocks)), qwen3_dir, hf_greedy)
    assert engine.spec.qk_norm and engine.spec.head_dim == 32


def test_mixtures_of_experts_match_transformers_batched_with_prefix_hits_and_preemptions(moe_dir, hf_greedy):
    engine, _ = check_batched_prefix_hits_and_preemptions(
        lambda blocks: LLMEngine(moe_dir, EngineConfig(block_size=8, num_kv_blocks=blocks)), moe_dir, hf_greedy)
    assert engine.spec.num_experts == 4 and engine.spec.experts_per_token == 2
    assert engine.spec.moe_layers == ({0, 1} if "mixtral" in moe_dir.name else {1})
    assert not engine._runner.use_decode_graphs(4, 64)  # its experts are picked on the host: never captured

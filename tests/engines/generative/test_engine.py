"""LLMEngine behaviour a user notices: sampling, stops, limits, aborts, deadlines, overload."""

from __future__ import annotations

import threading

import pytest

from sluice.clock import VirtualClock
from sluice.engines.generative import EngineConfig, LLMEngine, SamplingParams
from tests.engines.generative.conftest import VOCAB, greedy, prompts, run_to_completion


@pytest.fixture(scope="module")
def engine(llama_dir) -> LLMEngine:
    return LLMEngine(llama_dir, EngineConfig(block_size=8, num_kv_blocks=128))


def _one(engine: LLMEngine, prompt: list[int], params: SamplingParams, rid: str = "x") -> list[int]:
    engine.add_request(rid, prompt, params)
    return run_to_completion(engine)[rid]


def test_seeded_sampling_is_reproducible_whatever_runs_beside_it(engine):
    prompt = prompts(10, 1, 12, 12)[0]
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = _one(engine, prompt, params)
    for i, other in enumerate(prompts(11, 3, 5, 30)):
        engine.add_request(f"noise{i}", other, SamplingParams(max_tokens=15, temperature=1.0, ignore_eos=True))
    engine.add_request("x", prompt, params)
    assert run_to_completion(engine)["x"] == alone
    assert _one(engine, prompt, SamplingParams(max_tokens=20, temperature=0.9, seed=99, ignore_eos=True)) != alone


def test_top_k_one_equals_greedy(engine):
    prompt = prompts(12, 1, 9, 9)[0]
    sampled = _one(engine, prompt, SamplingParams(max_tokens=12, temperature=1.3, top_k=1, ignore_eos=True))
    assert sampled == _one(engine, prompt, greedy(12))


def test_min_p_keeps_the_tokens_at_least_that_fraction_as_likely_as_the_top_one(engine):
    import math

    import torch

    from sluice.engines.generative.sampler import Sampler

    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]])
    probs = Sampler("cpu")._probabilities(logits, [SamplingParams(temperature=1.0, min_p=0.5)])
    assert probs[0].tolist() == pytest.approx([0.625, 0.375, 0.0])  # 0.2 < 0.5 x 0.5: dropped
    prompt = prompts(12, 1, 9, 9)[0]
    sampled = _one(engine, prompt, SamplingParams(max_tokens=12, temperature=1.3, min_p=1.0, ignore_eos=True))
    assert sampled == _one(engine, prompt, greedy(12))  # only the top token is as likely as itself
    with pytest.raises(ValueError):
        SamplingParams(min_p=1.5)


def test_stop_token_ids_and_max_tokens(engine):
    prompt = prompts(13, 1, 9, 9)[0]
    reference = _one(engine, prompt, greedy(12))
    stop_at = reference[5]
    first = reference.index(stop_at)
    engine.add_request("s", prompt, greedy(12, stop_token_ids=(stop_at,)))
    outs = [o for _ in range(100) for o in engine.step() if o.request_id == "s"]
    assert [t for o in outs for t in o.new_token_ids] == reference[:first + 1]
    assert outs[-1].is_finished and outs[-1].finish_reason == "stop"
    assert len(_one(engine, prompt, greedy(7))) == 7


def test_min_tokens_blocks_stop_ids(engine):
    prompt = prompts(13, 1, 9, 9)[0]
    reference = _one(engine, prompt, greedy(12))
    out = _one(engine, prompt, greedy(12, stop_token_ids=(reference[0],), min_tokens=4))
    assert len(out) >= 4 and reference[0] not in out[:4]


def test_abort_from_another_thread_frees_blocks_within_one_step(engine):
    engine.add_request("long", prompts(14, 1, 30, 30)[0], greedy(200))
    engine.step()
    assert engine.stats().kv_cache_usage > 0
    threading.Thread(target=engine.abort, args=(["long"],)).start()
    threading.Event().wait(0.05)
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("long", "abort")]
    assert engine.stats().kv_cache_usage == 0.0 and not engine.has_unfinished()


def test_deadline_drops_the_sequence(llama_dir):
    clock = VirtualClock(100.0)
    engine = LLMEngine(llama_dir, EngineConfig(block_size=8, num_kv_blocks=32), clock=clock)
    engine.add_request("d", prompts(15, 1, 10, 10)[0], greedy(50), deadline=101.0)
    engine.step()
    clock.advance(2.0)
    outs = engine.step()
    assert [(o.request_id, o.finish_reason, o.is_finished) for o in outs] == [("d", "deadline", True)]
    assert engine.stats().kv_cache_usage == 0.0


def test_invalid_requests_are_value_errors(engine, llama_dir):
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError):
        engine.add_request("e", [], greedy(3))
    with pytest.raises(ValueError):
        engine.add_request("e", [10**6], greedy(3))
    small = LLMEngine(llama_dir, EngineConfig(block_size=8, num_kv_blocks=8))
    with pytest.raises(ValueError):  # 80 tokens can never fit a 64-token KV cache
        small.add_request("e", [5] * 50, greedy(30))


def test_gpu_memory_utilization_leaves_the_kv_cache_what_weights_and_activations_do_not_take():
    from sluice.engines.generative.model_runner import kv_blocks_for

    gib = 1 << 30
    # 80 GiB device, 20 GiB in use (weights), 2 GiB of activations: 0.9 x 80 - 20 - 2 = 50 GiB of 1 MiB blocks
    assert kv_blocks_for(80 * gib, 60 * gib, 0.9, 2 * gib, 1 << 20) == 50 * 1024
    with pytest.raises(ValueError, match="no room for a KV cache"):
        kv_blocks_for(80 * gib, 10 * gib, 0.9, 2 * gib, 1 << 20)
    with pytest.raises(ValueError, match="CUDA"):
        EngineConfig(gpu_memory_utilization=0.9)  # the CPU has no device memory to share out
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        EngineConfig(device="cuda", gpu_memory_utilization=1.5)


def test_overload_beyond_the_kv_cache_all_finish(llama_dir):
    # 40 requests of ~60 tokens each against a 20 x 8 = 160-token cache
    engine = LLMEngine(llama_dir, EngineConfig(block_size=8, num_kv_blocks=20, max_num_seqs=16))
    batch = prompts(16, 40, 10, 40)
    for i, prompt in enumerate(batch):
        engine.add_request(f"o{i}", prompt, greedy(20))
    done = run_to_completion(engine)
    assert all(len(done[f"o{i}"]) == 20 for i in range(len(batch)))
    stats = engine.stats()
    assert stats.num_preemptions_total > 0 and stats.kv_cache_usage == 0.0


def test_a_failed_forward_pass_ends_only_that_steps_sequences_and_the_engine_goes_on(llama_dir, monkeypatch):
    engine = LLMEngine(llama_dir, EngineConfig(block_size=8, num_kv_blocks=64, max_num_seqs=1))
    engine.add_request("running", prompts(15, 1, 20, 20)[0], greedy(50))
    engine.step()
    queued = prompts(16, 1, 20, 20)[0]
    engine.add_request("queued", queued, greedy(10))

    def broken(_inp):
        raise RuntimeError("device fault")

    monkeypatch.setattr(engine._runner, "execute", broken)
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason, o.is_finished) for o in outputs] == [("running", "error", True)]
    monkeypatch.undo()
    assert run_to_completion(engine)["queued"] == _one(engine, queued, greedy(10), rid="again")
    assert engine.stats().kv_cache_usage == 0.0


def test_a_failed_schedule_ends_every_sequence_with_an_error_and_the_engine_goes_on(engine, monkeypatch):
    engine.add_request("running", prompts(15, 1, 20, 20)[0], greedy(50))
    engine.step()
    engine.add_request("queued", prompts(16, 1, 20, 20)[0], greedy(50))

    def broken(_now):
        raise RuntimeError("scheduler bug")

    monkeypatch.setattr(engine._scheduler, "schedule", broken)
    with pytest.raises(RuntimeError):
        engine.step()
    outputs = engine.fail_all()
    assert sorted((o.request_id, o.finish_reason, o.is_finished) for o in outputs) == [
        ("queued", "error", True), ("running", "error", True)]
    assert engine.stats().kv_cache_usage == 0.0 and not engine.has_unfinished()
    monkeypatch.undo()
    prompt = prompts(17, 1, 9, 9)[0]
    assert len(_one(engine, prompt, greedy(5), rid="running")) == 5  # ids are free again


def test_a_request_that_would_wait_past_its_deadline_is_refused_at_once(llama_dir):
    clock = VirtualClock(100.0)
    engine = LLMEngine(llama_dir, EngineConfig(block_size=8, num_kv_blocks=64, max_num_seqs=1), clock=clock)
    engine.add_request("running", prompts(17, 1, 10, 10)[0], greedy(100))
    engine.step()
    engine.add_request("ahead", prompts(18, 1, 10, 10)[0], greedy(4), deadline=clock.now() + 100)
    for _ in range(12):  # 1.2 s in which the one sequence slot stays taken: nothing is admitted
        engine.step()
        clock.advance(0.1)
    engine.add_request("behind", prompts(19, 1, 10, 10)[0], greedy(4), deadline=clock.now() + 200)
    engine.add_request("urgent", prompts(20, 1, 10, 10)[0], greedy(4), deadline=clock.now() + 10)
    finished = [(o.request_id, o.finish_reason) for o in engine.step() if o.is_finished]
    assert finished == [("behind", "refused")]  # "urgent" goes first: nothing holds it back
    assert engine.stats().num_waiting == 2


@pytest.mark.parametrize("blocked, temperature", [
    ((10**8,), 0.0),               # a token id outside the vocabulary
    (tuple(range(VOCAB)), 1.0),    # no token left to draw: the probabilities are NaN
])
def test_a_sequence_that_cannot_be_sampled_ends_alone(engine, monkeypatch, blocked, temperature):
    """Bad values that got past validation end their own sequence, not the batch beside it."""
    other, victim = prompts(18, 2, 12, 12)
    reference = _one(engine, other, greedy(8), rid="reference")
    monkeypatch.setattr(engine, "eos_token_ids", blocked)  # blocked until min_tokens
    engine.add_request("other", other, greedy(8))
    engine.add_request("bad", victim, SamplingParams(max_tokens=8, min_tokens=4, temperature=temperature))
    finished: dict[str, str | None] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.is_finished:
                finished[out.request_id] = out.finish_reason
    assert finished == {"bad": "error", "other": "length"}
    assert tokens["other"] == reference
    assert engine.stats().kv_cache_usage == 0.0


@pytest.mark.parametrize("temperature", [1e-45, 1e-9, 9e-6])
def test_a_vanishing_temperature_is_greedy(engine, temperature):
    prompt = prompts(19, 1, 10, 10)[0]
    params = SamplingParams(max_tokens=8, temperature=temperature, ignore_eos=True)
    assert _one(engine, prompt, params) == _one(engine, prompt, greedy(8))


def test_stop_token_ids_outside_the_vocabulary_and_seeds_beyond_64_bits_are_refused(engine):
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request("v", [5, 6], greedy(3, stop_token_ids=(99_999_999,), min_tokens=1))
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    assert not engine.has_unfinished()


def test_max_tokens_beyond_the_context_is_refused_not_cut(engine):
    with pytest.raises(ValueError, match=r"maximum context length is 512 tokens.*510 in the prompt, 10 in"):
        engine.add_request("c", [5] * 510, greedy(10))
    assert not engine.has_unfinished()

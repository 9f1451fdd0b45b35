"""Log-probabilities, logit bias and OpenAI's presence and frequency penalties.

The engine's log-probabilities are checked against `transformers`' own forward pass over the same
tokens: a client scoring text with sluice must get the numbers the model gives, whatever else is
batched beside the request and wherever its prefill was chunked.
"""

from __future__ import annotations

import pytest
import torch

from sluice.engines.generative import EngineConfig, LLMEngine, SamplingParams
from sluice.engines.generative.engine import RequestOutput
from sluice.engines.generative.sampler import Sampler, SampleRow
from sluice.engines.generative.sequence import TokenLogprobs
from tests.engines.generative.conftest import VOCAB, greedy, prompts


@pytest.fixture(scope="module")
def engine(llama_dir) -> LLMEngine:
    # a small prefill budget: longer prompts are chunked across steps
    return LLMEngine(llama_dir, EngineConfig(block_size=8, num_kv_blocks=128, max_num_batched_tokens=24))


def _outputs(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def _reference(model_dir, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each position that chose one of `output`'s tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return logits[len(prompt) - 1:len(prompt) - 1 + len(output)].log_softmax(dim=-1)


def test_logprobs_are_the_models_own_with_other_requests_batched_beside(engine, llama_dir):
    prompt = prompts(21, 1, 40, 40)[0]  # 40 tokens: chunked over two steps
    for i, other in enumerate(prompts(22, 3, 5, 30)):
        engine.add_request(f"noise{i}", other, SamplingParams(max_tokens=9, temperature=1.0, ignore_eos=True))
    engine.add_request("scored", prompt, greedy(10, logprobs=5))
    outs = _outputs(engine)
    assert all(not o.logprobs for rid, per in outs.items() if rid != "scored" for o in per)  # asked for none
    reported: list[TokenLogprobs] = [lp for o in outs["scored"] for lp in o.logprobs]
    output = [t for o in outs["scored"] for t in o.new_token_ids]
    assert [lp.token_id for lp in reported] == output and len(output) == 10
    expected = _reference(llama_dir, prompt, output)
    for position, lp in enumerate(reported):
        row = expected[position]
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        values, ids = row.topk(5)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)
        assert lp.top[0][0] == lp.token_id  # greedy chose the most likely token


def test_logprobs_zero_reports_only_the_chosen_token_and_sampling_reports_the_raw_distribution(engine, llama_dir):
    prompt = prompts(23, 1, 12, 12)[0]
    engine.add_request("hot", prompt, SamplingParams(max_tokens=6, temperature=1.5, seed=7, ignore_eos=True,
                                                     logprobs=0))
    outs = _outputs(engine)["hot"]
    reported = [lp for o in outs for lp in o.logprobs]
    assert all(lp.top == () for lp in reported)
    expected = _reference(llama_dir, prompt, [lp.token_id for lp in reported])
    # the model's distribution, not the temperature-flattened one the token was drawn from
    assert [lp.logprob for lp in reported] == pytest.approx(
        [expected[i, lp.token_id].item() for i, lp in enumerate(reported)], abs=1e-4)


def test_a_large_logit_bias_forces_a_token_and_a_negative_one_bans_it(engine):
    prompt = prompts(24, 1, 10, 10)[0]
    engine.add_request("forced", prompt, greedy(6, logit_bias=((17, 100.0),)))
    engine.add_request("plain", prompt, greedy(6))
    outs = _outputs(engine)
    forced = [t for o in outs["forced"] for t in o.new_token_ids]
    plain = [t for o in outs["plain"] for t in o.new_token_ids]
    assert forced == [17] * 6
    engine.add_request("banned", prompt, greedy(6, logit_bias=((plain[0], -100.0),)))
    banned = [t for o in _outputs(engine)["banned"] for t in o.new_token_ids]
    assert plain[0] not in banned[:1]


def test_a_logit_bias_outside_the_vocabulary_is_refused(engine):
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("bad", [5, 6], greedy(2, logit_bias=((VOCAB, 1.0),)))


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                          ("logprobs", 21), ("logprobs", -1)])
def test_out_of_range_parameters_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def _row(params: SamplingParams, prompt: list[int], output: list[int]) -> SampleRow:
    return SampleRow("r", params, prompt + output, len(output), ())


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    sampler = Sampler("cpu")
    logits = torch.zeros(1, 8)
    logits[0, 2] = 3.0  # appears in the prompt only: never penalised
    logits[0, 4] = 3.0  # generated twice
    logits[0, 5] = 2.5  # generated once
    logits[0, 6] = 1.5  # never seen
    params = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.4)
    sampler._process(logits, 0, _row(params, [2, 2, 2], [4, 5, 4]))
    assert logits[0, 2] == 3.0
    assert logits[0, 4] == pytest.approx(3.0 - 0.5 - 2 * 0.4)
    assert logits[0, 5] == pytest.approx(2.5 - 0.5 - 0.4)
    assert logits[0, 6] == 1.5


def test_penalties_steer_greedy_sampling_away_from_repeats():
    sampler = Sampler("cpu")
    logits = torch.tensor([[0.0, 2.0, 1.8, 0.0]])
    row = _row(SamplingParams(temperature=0.0, frequency_penalty=0.5), [0], [1])
    plain = _row(SamplingParams(temperature=0.0), [0], [1])
    assert sampler.sample(logits.clone(), [plain])[0].token_id == 1
    draw = sampler.sample(logits.clone(), [row])[0]
    assert draw.token_id == 2 and draw.logprobs is None


def _check_prompt_logprobs(model_dir, prompt: list[int], reported: tuple[TokenLogprobs, ...], k: int) -> None:
    """Each prompt token but the first: its log-probability and the top k at the position before."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        expected = model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)
    assert [lp.token_id for lp in reported] == prompt[1:]
    for position, lp in enumerate(reported):
        assert lp.logprob == pytest.approx(expected[position, lp.token_id].item(), abs=1e-4)
        values, ids = expected[position].topk(k)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_prompt_logprobs_come_with_the_first_token_over_chunked_prefill_and_ignore_the_prefix_cache(
        engine, llama_dir):
    prompt = prompts(25, 1, 45, 45)[0]  # chunked over steps of 24 tokens
    engine.add_request("warm", prompt, greedy(2))  # caches the prompt's full blocks
    _outputs(engine)
    engine.add_request("echo", prompt, greedy(3, logprobs=1, prompt_logprobs=2))
    outs = _outputs(engine)["echo"]
    firsts = [o for o in outs if o.prompt_logprobs is not None]
    assert len(firsts) == 1 and firsts[0] is outs[0] and outs[0].new_token_ids
    assert outs[0].num_cached_tokens == 0  # its prompt was computed, not taken from the cache
    _check_prompt_logprobs(llama_dir, prompt, firsts[0].prompt_logprobs, 2)


def test_prompt_logprobs_are_exact_and_whole_when_sequences_are_preempted(llama_dir):
    # 12 blocks of 8 = 96 tokens of KV for 5 requests needing ~70 each, prefilled 8 tokens a step:
    # they are preempted and recomputed, some before their prompt was all computed
    small = LLMEngine(llama_dir, EngineConfig(block_size=8, num_kv_blocks=12, max_num_batched_tokens=8))
    batch = prompts(26, 5, 30, 50)
    for i, prompt in enumerate(batch):
        small.add_request(f"p{i}", prompt, greedy(25, prompt_logprobs=1))
    outs: dict[str, list[RequestOutput]] = {}
    computed_before_first: dict[str, int] = {}  # prompt tokens computed until the first token came
    while small.has_unfinished():
        for out in small.step():
            outs.setdefault(out.request_id, []).append(out)
        for request_id, num_tokens in small.last_step_tokens.items():
            if not any(o.new_token_ids for o in outs.get(request_id, [])):
                computed_before_first[request_id] = computed_before_first.get(request_id, 0) + num_tokens
    assert any(computed_before_first[f"p{i}"] > len(prompt) for i, prompt in enumerate(batch)), \
        "no prompt was recomputed part way: the test no longer covers what it is for"
    for i, prompt in enumerate(batch):
        reported = [o.prompt_logprobs for o in outs[f"p{i}"] if o.prompt_logprobs is not None]
        assert len(reported) == 1
        _check_prompt_logprobs(llama_dir, prompt, reported[0], 1)  # whole, in order, none twice


def test_choices_of_one_prompt_compute_it_once_and_share_its_blocks(llama_dir, hf_greedy):
    engine = LLMEngine(llama_dir, EngineConfig(block_size=8, num_kv_blocks=128))
    prompt = prompts(27, 1, 61, 61)[0]  # 7 full blocks and 5 tokens
    engine.add_request("c0", prompt, greedy(6))
    for i in (1, 2, 3):
        engine.add_request(f"c{i}", prompt, greedy(6), prefix_of="c0")
    first = engine.step()  # the first choice's prefill; the others wait for its blocks
    assert engine.last_step_tokens == {"c0": 61} and [o.request_id for o in first] == ["c0"]
    outs = _outputs(engine)
    expected = hf_greedy(llama_dir, prompt, 6)
    assert outs["c0"][-1].num_cache_write_tokens == 56  # its prompt's 7 full blocks, not its output's
    for i in (1, 2, 3):
        assert [t for o in outs[f"c{i}"] for t in o.new_token_ids] == expected
        assert outs[f"c{i}"][0].num_cached_tokens == 56 and outs[f"c{i}"][-1].num_cache_write_tokens == 0
    assert engine.stats().prefix_cache_hit_tokens == 3 * 56


def test_a_choice_whose_first_is_aborted_is_admitted_on_its_own(llama_dir):
    engine = LLMEngine(llama_dir, EngineConfig(block_size=8, num_kv_blocks=128))
    prompt = prompts(28, 1, 20, 20)[0]
    engine.add_request("c0", prompt, greedy(3))
    engine.add_request("c1", prompt, greedy(3), prefix_of="c0")
    engine.abort(["c0"])
    outs = _outputs(engine)
    assert len([t for o in outs["c1"] for t in o.new_token_ids]) == 3


def test_a_sequence_whose_prompt_logprobs_fail_ends_alone(llama_dir, hf_greedy, monkeypatch):
    engine = LLMEngine(llama_dir, EngineConfig(block_size=8, num_kv_blocks=128))
    prompt = prompts(29, 1, 12, 12)[0]

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(engine._sampler, "prompt_logprobs", broken)
    engine.add_request("scored", prompt, greedy(4, prompt_logprobs=1))
    engine.add_request("plain", prompt, greedy(4))
    outs = _outputs(engine)
    assert outs["scored"][-1].finish_reason == "error" and not outs["scored"][-1].new_token_ids
    assert [t for o in outs["plain"] for t in o.new_token_ids] == hf_greedy(llama_dir, prompt, 4)


def test_a_bfloat16_engine_on_the_cpu_gives_the_models_log_probabilities_to_bf16_precision(llama_dir):
    """bf16 weights and KV cache on the CPU (faster where the CPU has bf16 instructions): chunked,
    batched beside other requests and after a prefix-cache hit, each chosen token's log-probability
    is transformers' float32 one to within bf16's rounding, and its top alternatives are too."""
    engine = LLMEngine(llama_dir, EngineConfig(block_size=8, num_kv_blocks=128, max_num_batched_tokens=24,
                                               dtype="bfloat16"))
    assert engine._runner.cache.k.dtype == torch.bfloat16
    prompt = prompts(21, 1, 40, 40)[0]
    for round_ in range(2):  # the second round's prompt is a prefix-cache hit
        for i, other in enumerate(prompts(22 + round_, 3, 5, 30)):
            engine.add_request(f"noise{round_}-{i}", other, SamplingParams(max_tokens=9, temperature=1.0,
                                                                            ignore_eos=True))
        engine.add_request(f"scored{round_}", prompt, greedy(10, logprobs=5))
        outs = _outputs(engine)
        reported = [lp for o in outs[f"scored{round_}"] for lp in o.logprobs]
        output = [t for o in outs[f"scored{round_}"] for t in o.new_token_ids]
        assert len(output) == 10
        expected = _reference(llama_dir, prompt, output)
        for position, lp in enumerate(reported):
            assert lp.logprob == pytest.approx(expected[position][lp.token_id].item(), abs=0.05)
            assert [v for _, v in lp.top] == pytest.approx([expected[position][t].item() for t, _ in lp.top], abs=0.05)
    assert engine.stats().prefix_cache_hit_tokens >= 32

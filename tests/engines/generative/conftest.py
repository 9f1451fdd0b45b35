"""Tiny random-weight models built with transformers' own classes, and their greedy reference output."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from sluice.engines.generative import LLMEngine, SamplingParams

VOCAB = 384


def _save(model: PreTrainedModel, path: Path) -> Path:
    model.generation_config.eos_token_id = None  # greedy comparisons run to max_tokens
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_theta=500.0, initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    return _save(LlamaForCausalLM(config).eval(), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def llama3_rope_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama 3.1-style RoPE scaling, with an original context short enough (64) that the frequencies
    fall in all three bands (kept, divided by the factor, blended)."""
    torch.manual_seed(2)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_theta=500.0, rope_scaling=scaling, initializer_range=0.1, bos_token_id=1,
                         eos_token_id=2)
    return _save(LlamaForCausalLM(config).eval(), tmp_path_factory.mktemp("llama3-rope"))


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(1)
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512, initializer_range=0.1,
                        bos_token_id=1, eos_token_id=2)
    return _save(GPT2LMHeadModel(config).eval(), tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def windowed_dir(request, tmp_path_factory):
    """A 16-token attention window, far shorter than the prompts: on every layer (Mistral), or on
    the second layer only (Qwen2's use_sliding_window from max_window_layers = 1)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(4)
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, rope_theta=500.0, initializer_range=0.1,
                 bos_token_id=1, eos_token_id=2, sliding_window=16)
    if request.param == "mistral":
        model = MistralForCausalLM(MistralConfig(**shape))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=True, max_window_layers=1))
    return _save(model.eval(), tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3: each query and key head RMS-normalised before RoPE, a head_dim (32) that is not
    hidden / heads (16), tied embeddings."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(5)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         rope_theta=500.0, initializer_range=0.1, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # norms of ones would hide a norm left out or applied to the wrong heads
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return _save(model, tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mixtures of 4 experts, 2 per token: Mixtral's on both layers, renormalised; Qwen3-MoE's with
    its first layer dense (`mlp_only_layers`) and the chosen probabilities left as they are."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(6)
    shape = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=512, rope_theta=500.0, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
                 num_experts_per_tok=2)
    if request.param == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**shape, intermediate_size=96, num_local_experts=4))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, intermediate_size=128, moe_intermediate_size=48,
                                                   num_experts=4, head_dim=32, mlp_only_layers=[0]))
    return _save(model.eval(), tmp_path_factory.mktemp(request.param))


_HF_CACHE: dict[Path, PreTrainedModel] = {}


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[[Path, list[int], int], list[int]]:
    """transformers' `generate(do_sample=False)` continuation of one prompt."""

    def run(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
        if model_dir not in _HF_CACHE:
            from transformers import AutoModelForCausalLM

            _HF_CACHE[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        model = _HF_CACHE[model_dir]
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
        return out[0, len(prompt):].tolist()

    return run


@pytest.fixture(params=["llama", "gpt2"])
def model_dir(request: pytest.FixtureRequest, llama_dir: Path, gpt2_dir: Path) -> Path:
    """Each architecture the engine implements, in turn."""
    return llama_dir if request.param == "llama" else gpt2_dir


def greedy(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list[int]]:
    """Step until idle; every request's output token ids."""
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("engine did not finish")


def prompts(seed: int, count: int, low: int, high: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def check_batch(engine: LLMEngine, model_dir: Path, hf_greedy: Callable[[Path, list[int], int], list[int]],
                batch: list[list[int]], max_tokens: list[int], join_every: int = 1,
                salt: Callable[[int], str] = lambda i: "") -> dict[str, list[int]]:
    """Requests join one every `join_every` steps; every output must equal the single-request reference."""
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(batch))
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % join_every == 0:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, greedy(max_tokens[i]), salt=salt(i))
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    for i, prompt in enumerate(batch):
        assert tokens[f"r{i}"] == hf_greedy(model_dir, prompt, max_tokens[i]), f"request {i}"
    return tokens


def check_batched_prefix_hits_and_preemptions(make_engine: Callable[[int], LLMEngine], model_dir: Path,
                                              hf_greedy: Callable[[Path, list[int], int], list[int]],
                                              longest_prompt: int = 60) -> tuple[LLMEngine, LLMEngine]:
    """The engine's main promise in one go, for an engine made some other way (on CUDA, with
    decode graphs): 8 requests of 3 to `longest_prompt` tokens joining two steps apart, then 5
    sharing a 40-token prefix (cache hits), then 6 in 12 blocks of KV (preemptions), each output
    equal to `transformers'`. `make_engine(num_kv_blocks)`; returns the engine of 256 blocks and
    the one of 12."""
    engine = make_engine(256)
    check_batch(engine, model_dir, hf_greedy, prompts(1, 8, 3, longest_prompt), [5 + 3 * i for i in range(8)],
                join_every=2)
    assert engine.stats().kv_cache_usage == 0.0
    shared = prompts(3, 1, 40, 40)[0]
    hits_before = engine.stats().prefix_cache_hit_tokens
    check_batch(engine, model_dir, hf_greedy, [shared + t for t in prompts(4, 4, 1, 12)] + [shared], [10] * 5,
                join_every=4)
    assert engine.stats().prefix_cache_hit_tokens - hits_before >= 4 * 40 - 8
    tight = make_engine(12)
    check_batch(tight, model_dir, hf_greedy, prompts(5, 6, 10, 30), [30] * 6, join_every=1)
    assert tight.stats().num_preemptions_total > 0
    return engine, tight

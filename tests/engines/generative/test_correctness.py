"""The engine's main promise: greedy output equals transformers' `generate()` token for token."""

from __future__ import annotations

import pytest

from sluice.engines.generative import EngineConfig, LLMEngine
from tests.engines.generative.conftest import greedy, prompts, run_to_completion


@pytest.fixture(params=["llama", "gpt2"])
def model_dir(request, llama_dir, gpt2_dir):
    return llama_dir if request.param == "llama" else gpt2_dir


def test_single_request_matches_transformers(model_dir, hf_greedy):
    engine = LLMEngine(model_dir, EngineConfig(block_size=8, num_kv_blocks=64))
    prompt = prompts(0, 1, 20, 20)[0]
    engine.add_request("a", prompt, greedy(24))
    assert run_to_completion(engine)["a"] == hf_greedy(model_dir, prompt, 24)

"""lm-evaluation-harness, the field's standard evaluation client, through its `local-completions`
model against a real server: loglikelihood requests (prompts sent as batches of token-id lists,
echoed with their log-probabilities) give the numbers `transformers` gives for the same tokens,
and generate_until requests get their text."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import ServerProcess, start_server, write_tiny_lm_model

pytestmark = pytest.mark.slow

MODEL = "tiny"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    repo = write_tiny_lm_model(tmp_path_factory.mktemp("repo"), MODEL)
    server = start_server(repo, tmp_path_factory.mktemp("log"))
    yield server, repo / MODEL / "1"
    server.stop()


def _harness(server: ServerProcess, model_dir: Path, batch_size: int):  # type: ignore[no-untyped-def]
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model=MODEL, tokenizer_backend="huggingface",
                               tokenizer=str(model_dir), max_length=1024, batch_size=batch_size, max_retries=1)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_loglikelihoods_equal_transformers_for_the_same_tokens(served, batch_size):
    from lm_eval.api.instance import Instance
    from transformers import AutoModelForCausalLM

    server, model_dir = served
    harness = _harness(server, model_dir, batch_size)
    pairs = [("The weather today", " is nice"), ("Once upon a time", " there was"), ("Hello", " world again")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    results = harness.loglikelihood(requests)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for (context, continuation), (logprob, is_greedy) in zip(pairs, results, strict=True):
        context_ids, continuation_ids = harness.tok_encode(context), harness.tok_encode(continuation)
        with torch.inference_mode():
            logits = model(torch.tensor([context_ids + continuation_ids])).logits[0].float()
        predicted = logits[len(context_ids) - 1:-1].log_softmax(dim=-1)
        expected = sum(predicted[i, token].item() for i, token in enumerate(continuation_ids))
        assert logprob == pytest.approx(expected, abs=1e-3)
        assert is_greedy == all(predicted[i].argmax().item() == t for i, t in enumerate(continuation_ids))


def test_generate_until_returns_each_requests_greedy_text(served):
    from lm_eval.api.instance import Instance

    server, model_dir = served
    harness = _harness(server, model_dir, 1)
    contexts = ["Hello", "Once upon a time"]
    requests = [Instance("generate_until", {}, (context, {"until": ["\n\n"], "max_gen_toks": 6}), i)
                for i, context in enumerate(contexts)]
    texts = harness.generate_until(requests)
    for context, text in zip(contexts, texts, strict=True):  # what the server gives asked directly
        direct = httpx.post(f"{server.url}/v1/completions", timeout=60, headers={"Cache-Control": "no-cache"}, json={
            "model": MODEL, "prompt": harness.tok_encode(context), "max_tokens": 6, "temperature": 0,
            "stop": ["\n\n"]}).json()
        assert text == direct["choices"][0]["text"]


def test_generate_until_with_more_stop_strings_than_openais_four_as_humaneval_asks(served):
    """HumanEval's `until` has five stops, and the harness adds the EOS text: it sends six (vLLM
    takes them all; OpenAI documents four)."""
    from lm_eval.api.instance import Instance

    server, model_dir = served
    harness = _harness(server, model_dir, 1)
    until = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]
    requests = [Instance("generate_until", {}, ("def add(a, b):", {"until": list(until), "max_gen_toks": 8}), 0)]
    (text,) = harness.generate_until(requests)
    direct = httpx.post(f"{server.url}/v1/completions", timeout=60, headers={"Cache-Control": "no-cache"}, json={
        "model": MODEL, "prompt": harness.tok_encode("def add(a, b):"), "max_tokens": 8, "temperature": 0,
        "stop": [*until, harness.tokenizer.decode([harness.eot_token_id])]})
    assert direct.status_code == 200, direct.text
    assert text == direct.json()["choices"][0]["text"]


def test_with_no_tokenizer_of_its_own_the_harness_tokenizes_through_the_server(served):
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    server, model_dir = served
    remote = LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model=MODEL, tokenizer_backend="auto",
                                 max_length=1024, batch_size=2, max_retries=1)
    assert remote.tokenizer_backend == "remote"  # it found /tokenizer_info and /tokenize
    pairs = [("The weather today", " is nice"), ("Once upon a time", " there was")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    local = _harness(server, model_dir, 2)
    assert remote.tok_encode("Once upon a time") == local.tok_encode("Once upon a time")
    by_server, by_files = remote.loglikelihood(requests), local.loglikelihood(requests)
    assert [greedy for _, greedy in by_server] == [greedy for _, greedy in by_files]
    assert [value for value, _ in by_server] == pytest.approx([value for value, _ in by_files], abs=1e-5)

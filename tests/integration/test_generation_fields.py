"""OpenAI's further generation fields through a real server and the real `openai` SDK:
log-probabilities (completions' `logprobs: k`, chat's `logprobs` and `top_logprobs`, in the shapes
the SDK parses), logit bias and penalties, n choices, batches of prompts, echo and prompt scoring,
vLLM's tokenizer endpoints, and 400s naming the field."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from tests.conftest import eventually, metric_total, start_server, write_tiny_lm_model

pytestmark = pytest.mark.slow

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_lm_server):
    return tiny_lm_server  # tests/integration/conftest.py


@pytest.fixture
def client(tiny_lm_client):
    return tiny_lm_client


def test_completion_logprobs_name_each_token_and_its_alternatives(client):
    out = client.completions.create(model=MODEL, prompt="The weather today is", max_tokens=6, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert value <= 0 and math.isfinite(value)
        assert 3 <= len(top) <= 4 and top[token] == value  # the 3 most likely, and the chosen one
        assert value == max(top.values())  # greedy chose the most likely
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)


def test_streamed_completion_logprobs_equal_the_unary_ones(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].logprobs
    tokens: list[str] = []
    values: list[float] = []
    offsets: list[int] = []
    for chunk in client.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
            offsets += chunk.choices[0].logprobs.text_offset
    assert tokens == whole.tokens
    assert values == pytest.approx(whole.token_logprobs, abs=1e-5)
    assert offsets == whole.text_offset


def test_chat_logprobs_with_top_logprobs_unary_and_streamed(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Say something"}], max_tokens=5,
                  temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert entry.top_logprobs[1].logprob <= entry.logprob
    streamed = [entry for chunk in client.chat.completions.create(stream=True, **kwargs)
                if chunk.choices and chunk.choices[0].logprobs is not None
                for entry in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)


def test_chat_logprobs_bytes_are_each_tokens_own_and_joined_give_the_text(client):
    """OpenAI: `bytes` is there for characters split over several tokens; joined, they are the
    text. A guided choice makes even a random-weight model write characters this byte-level
    vocabulary splits (each of 中's three bytes is a token of its own, decoded alone as U+FFFD)."""
    text = "中文 😀 ok"
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=30, logprobs=True,
                  top_logprobs=2, extra_body={"guided_choice": [text]})
    unary = client.chat.completions.create(**kwargs)
    streamed = [entry for chunk in client.chat.completions.create(stream=True, **kwargs)
                if chunk.choices and chunk.choices[0].logprobs is not None
                for entry in chunk.choices[0].logprobs.content]
    assert unary.choices[0].message.content == text
    for entries in (unary.choices[0].logprobs.content, streamed):
        assert any("\ufffd" in entry.token for entry in entries)  # a token that is part of a character
        assert b"".join(bytes(entry.bytes) for entry in entries).decode() == text
        for entry in entries:
            assert bytes(entry.bytes).decode(errors="replace") == entry.token
            assert all(bytes(top.bytes).decode(errors="replace") == top.token for top in entry.top_logprobs)


def test_completion_text_offsets_index_the_text_across_characters_split_over_tokens(client):
    """`text_offset[i]` is where token i starts in the text: the byte tokens of 中 or 😀 (U+FFFD
    each, alone) all start at their character, and the tokens after them where they are."""
    text = "中文 😀 ok"
    kwargs = dict(model=MODEL, prompt="中文 ok", max_tokens=30, logprobs=0, extra_body={"guided_choice": [text]})
    for echo in (False, True):
        choice = client.completions.create(echo=echo, **kwargs).choices[0]
        offsets = choice.logprobs.text_offset
        assert choice.text.endswith(text) and offsets == sorted(offsets) and offsets[-1] < len(choice.text)
        assert choice.text[offsets[-2]:] == " ok"
        streamed = [offset for chunk in client.completions.create(stream=True, echo=echo, **kwargs)
                    if chunk.choices and chunk.choices[0].logprobs for offset in chunk.choices[0].logprobs.text_offset]
        assert streamed == offsets


def test_chat_logprobs_without_top_logprobs_and_none_unless_asked(client):
    messages = [{"role": "user", "content": "Hello"}]
    asked = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                           logprobs=True, extra_body={"ignore_eos": True})
    assert [e.top_logprobs for e in asked.choices[0].logprobs.content] == [[], [], []]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


def test_a_large_logit_bias_forces_its_token(client):
    out = client.completions.create(model=MODEL, prompt="Anything", max_tokens=5, temperature=0, logprobs=0,
                                    logit_bias={"300": 100}, extra_body={"ignore_eos": True})
    tokens = out.choices[0].logprobs.tokens
    assert len(tokens) == 5 and len(set(tokens)) == 1


def test_special_tokens_and_the_stop_string_are_in_the_text_only_when_asked(client):
    """vLLM's `skip_special_tokens` (default true) and `include_stop_str_in_output` (default false)."""
    forced = dict(model=MODEL, prompt="Anything", max_tokens=3, temperature=0, logit_bias={"2": 100})  # <|user|>

    def text(**extra: object) -> str:
        return client.completions.create(**forced, extra_body={"ignore_eos": True, **extra}).choices[0].text

    assert text() == ""
    assert text(skip_special_tokens=False) == "<|user|>" * 3
    assert client.completions.create(**forced, stop=["<|user|>"], extra_body={"skip_special_tokens": False}
                                     ).choices[0].text == ""
    assert client.completions.create(**forced, stop=["<|user|>"], extra_body={
        "skip_special_tokens": False, "include_stop_str_in_output": True}).choices[0].text == "<|user|>"


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client):
    """vLLM's `truncate_prompt_tokens`: a prompt longer than the context is served from its end."""
    def prompt_tokens(**body: object) -> int:
        extra = {"truncate_prompt_tokens": body.pop("keep")}
        create = client.chat.completions.create if "messages" in body else client.completions.create
        return create(model=MODEL, max_tokens=1, extra_body=extra, **body).usage.prompt_tokens

    assert prompt_tokens(prompt=[5 + i % 1000 for i in range(2000)], keep=10) == 10  # 2,000 ids: twice the context
    assert prompt_tokens(prompt="the quick brown fox " * 50, keep=7) == 7
    assert prompt_tokens(messages=[{"role": "user", "content": "Tell me a long story"}], keep=3) == 3


def test_a_frequency_penalty_changes_what_greedy_decoding_repeats(client):
    kwargs = dict(model=MODEL, prompt="the the the the", max_tokens=24, temperature=0, logprobs=0,
                  extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs).choices[0].logprobs.tokens
    penalised = client.completions.create(frequency_penalty=2.0, presence_penalty=1.0, **kwargs)
    tokens = penalised.choices[0].logprobs.tokens
    # each repeat costs 2 more, plus 1 once: the greedy text repeats its tokens less
    assert max(tokens.count(t) for t in set(tokens)) <= max(plain.count(t) for t in set(plain))
    assert tokens != plain


def test_n_seeded_choices_are_each_reproducible_and_counted_once_as_a_request(server, client):
    ok = metric_total(server, "sluice_requests_total", model=MODEL, outcome="ok")
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=11,
                  extra_body={"ignore_eos": True})
    three = client.completions.create(n=3, **kwargs)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert len({c.text for c in three.choices}) > 1  # seeded seed, seed + 1, seed + 2
    assert three.usage.completion_tokens == 18 and three.usage.total_tokens == three.usage.prompt_tokens + 18
    assert [c.text for c in client.completions.create(n=3, **kwargs).choices] == [c.text for c in three.choices]
    assert client.completions.create(n=1, **kwargs).choices[0].text == three.choices[0].text
    assert metric_total(server, "sluice_requests_total", model=MODEL, outcome="ok") == ok + 3


def test_n_greedy_choices_are_equal(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], n=2,
                                         max_tokens=5, temperature=0)
    assert len(out.choices) == 2 and out.choices[0].message.content == out.choices[1].message.content


def test_n_streamed_choices_equal_the_unary_ones_and_each_finishes(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell"}], n=3, max_tokens=5, temperature=0.9,
                  seed=3, logprobs=True, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    texts = ["", "", ""]
    tokens: list[list[str]] = [[], [], []]
    finishes: list[int] = []
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            tokens[choice.index] += [e.token for e in (choice.logprobs.content if choice.logprobs else [])]
            if choice.finish_reason:
                finishes.append(choice.index)
        if not chunk.choices:
            assert chunk.usage.completion_tokens == 15
    assert texts == [c.message.content for c in whole.choices]
    assert tokens == [[e.token for e in c.logprobs.content] for c in whole.choices]
    assert sorted(finishes) == [0, 1, 2]


def test_a_client_that_disconnects_frees_all_its_choices(server, client):
    stream = client.completions.create(model=MODEL, prompt="Keep going", max_tokens=800, temperature=0.8, n=3,
                                       stream=True, extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(6), stream, strict=False):
        pass
    eventually(lambda: metric_total(server, "vllm:num_requests_running", model_name=MODEL) == 3,
              "the three running sequences never showed in the gauge")
    stream.close()
    eventually(lambda: metric_total(server, "vllm:num_requests_running", model_name=MODEL) == 0,
              "the disconnected client's sequences kept running")


def test_a_batch_of_prompts_answers_each_prompts_choices_in_order_and_sums_usage(client):
    kwargs = dict(model=MODEL, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kwargs) for p in ("Once upon", "The weather")]
    batch = client.completions.create(prompt=["Once upon", "The weather"], n=2, **kwargs)
    assert [(c.index, c.text) for c in batch.choices] == [
        (0, alone[0].choices[0].text), (1, alone[0].choices[0].text),
        (2, alone[1].choices[0].text), (3, alone[1].choices[0].text)]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 16
    streamed = ["", "", "", ""]
    for chunk in client.completions.create(prompt=["Once upon", "The weather"], n=2, stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [c.text for c in batch.choices]


def test_a_batch_of_token_id_prompts_is_scored_as_lm_evaluation_harness_sends_it(server):
    # lm-evaluation-harness's local-completions loglikelihood: prompts as lists of token ids, even
    # one; echo with logprobs 1 and max_tokens 1; the context's log-probabilities are read from the
    # echoed prompt
    prompts = [[7, 30, 111, 250], [42, 9, 200]]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0,
            "seed": 1234}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    assert [len(c["logprobs"]["token_logprobs"]) for c in choices] == [5, 4]  # each prompt and one token
    one = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": [prompts[1]]}, timeout=60).json()
    assert one["choices"][0]["logprobs"]["token_logprobs"] == choices[1]["logprobs"]["token_logprobs"]


def test_a_deadline_that_passes_while_n_choices_run_is_504_and_frees_them_all(server):
    body = {"model": MODEL, "prompt": "Keep going", "max_tokens": 900, "n": 3, "temperature": 0.8, "ignore_eos": True}
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers={"X-Request-Timeout-Ms": "700"},
                          timeout=60)
    assert response.status_code == 504, response.text
    eventually(lambda: metric_total(server, "vllm:num_requests_running", model_name=MODEL) == 0,
              "the expired request's sequences kept running")


def test_the_tokenizer_endpoints_agree_with_what_generation_counts(server, client):
    prompt = "The weather today is"
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}, timeout=60).json()
    usage = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0).usage
    assert tokens["count"] == len(tokens["tokens"]) == usage.prompt_tokens and tokens["max_model_len"] == 1024
    back = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}, timeout=60)
    assert back.json() == {"prompt": prompt}
    messages = [{"role": "user", "content": "Say something"}]
    chat = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages}, timeout=60).json()
    chat_usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0).usage
    assert chat["count"] == chat_usage.prompt_tokens
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=60).json()
    assert info["eos_token"] and info["model_max_length"] == 1024 and "messages" in info["chat_template"]



def test_the_chat_template_fields_shape_the_prompt_as_vllm_reads_them(server, client):
    """`continue_final_message` ends the prompt inside the assistant's last message (no end of
    turn, no new turn), `add_generation_prompt: false` opens no assistant turn; /tokenize and a
    chat completion render the same prompt."""
    def tokens(**body: object) -> list[int]:
        answer = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, **body}, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()["tokens"]

    started = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon"}]
    continued = tokens(messages=started, continue_final_message=True)
    assert continued == tokens(prompt="<|user|>\nHi<|endoftext|>\n<|assistant|>\nOnce upon", add_special_tokens=False)
    assert tokens(messages=started[:1], add_generation_prompt=False) == tokens(
        prompt="<|user|>\nHi<|endoftext|>\n", add_special_tokens=False)
    usage = client.chat.completions.create(model=MODEL, messages=started, max_tokens=1, temperature=0,
                                           extra_body={"continue_final_message": True,
                                                       "add_generation_prompt": False}).usage
    assert usage.prompt_tokens == len(continued)


@pytest.mark.parametrize("body, param", [
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"continue_final_message": True, "messages": [{"role": "user", "content": "x"}]}, "messages"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"x": "y" * 70000}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["not", "a", "map"]}, "chat_template_kwargs"),
])
def test_chat_template_fields_that_cannot_be_served_are_400(server, body, param):
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                                    "max_tokens": 2, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_tokenizer_requests_are_not_inferences_in_the_models_statistics(server):
    def successes() -> int:
        (stats,) = httpx.get(f"{server.url}/v2/models/{MODEL}/stats", timeout=60).json()["model_stats"]
        return stats["inference_stats"]["success"]["count"]

    before = successes()
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "a few words"}, timeout=60).status_code == 200
    assert successes() == before


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/detokenize", {"tokens": [5, 99_999_999]}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
])
def test_tokenizer_requests_the_model_cannot_take_are_400(server, path, body, param):
    response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_echo_with_max_tokens_zero_scores_the_prompt_as_evaluation_harnesses_ask(client):
    prompt = [7, 30, 111, 250, 42, 9]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = out.choices[0]
    logprobs = choice.logprobs
    assert out.usage.prompt_tokens == 6 and out.usage.completion_tokens == 0
    assert len(logprobs.tokens) == 6 and "".join(logprobs.tokens) == choice.text
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing predicts the first
    for token, value, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:],
                                 strict=True):
        assert value < 0 and top[token] == value and 1 <= len(top) <= 2
    # a prompt sent again (its blocks now cached) is scored the same: prompt log-probabilities skip the cache
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    assert again.choices[0].logprobs.token_logprobs == logprobs.token_logprobs


def test_echo_puts_the_prompt_before_the_text_unary_and_streamed(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0, echo=True, logprobs=2,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    plain = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0]
    assert whole.text == "Once upon a time" + plain.text
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert chunks[0].text == "Once upon a time"
    assert "".join(c.text for c in chunks) == whole.text
    streamed = [t for c in chunks if c.logprobs is not None for t in c.logprobs.tokens]
    assert streamed == whole.logprobs.tokens
    assert whole.logprobs.text_offset == sorted(whole.logprobs.text_offset)
    # the generated part's log-probabilities follow the prompt's, the last one greedy
    assert whole.logprobs.token_logprobs[-1] == max(whole.logprobs.top_logprobs[-1].values())


@pytest.mark.parametrize("path, body, param", [
    ("completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ("completions", {"prompt": "x", "min_p": 1.5}, "min_p"),
    ("completions", {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("completions", {"prompt": "x", "truncate_prompt_tokens": 5, "echo": True}, "truncate_prompt_tokens"),
    ("completions", {"prompt": "x", "skip_special_tokens": "no"}, "skip_special_tokens"),
    ("completions", {"prompt": "x", "stop": [f"s{i}" for i in range(65)]}, "stop"),
    ("completions", {"prompt": "x", "stop": ["a", ""]}, "stop"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "metadata": "x"}, "metadata"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "metadata": {"k": 5}}, "metadata"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "metadata": {"k": "v" * 513}}, "metadata"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "store": "yes"}, "store"),
])
def test_bad_values_are_400_naming_the_field(server, path, body, param):
    response = httpx.post(f"{server.url}/v1/{path}", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("path, body, param", [
    ("chat/completions", {**CHAT, "reasoning_effort": "high"}, "reasoning_effort"),  # its template takes none
    ("chat/completions", {**CHAT, "reasoning_effort": "extreme"}, "reasoning_effort"),
    ("chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities"),
    ("chat/completions", {**CHAT, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat/completions", {**CHAT, "web_search_options": {}}, "web_search_options"),
    ("chat/completions", {**CHAT, "verbosity": "low"}, "verbosity"),
    ("chat/completions", {**CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
    ("chat/completions", {**CHAT, "documents": [{"title": "a", "text": "b"}]}, "documents"),
    ("chat/completions", {**CHAT, "add_special_tokens": True}, "add_special_tokens"),
    ("completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ("completions", {"prompt": "x", "length_penalty": 0.5}, "length_penalty"),
    ("completions", {"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs"),
    ("completions", {"prompt": "x", "allowed_token_ids": [5, 6]}, "allowed_token_ids"),
    ("completions", {"prompt": "x", "bad_words": ["the"]}, "bad_words"),
    ("completions", {"prompt": "x", "return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    ("completions", {"prompt": "x", "spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ("completions", {"prompt": "x", "add_special_tokens": False}, "add_special_tokens"),
    ("completions", {"prompt": "x", "guided_regex": "a+", "guided_whitespace_pattern": " "},
     "guided_whitespace_pattern"),
    ("responses", {"input": "x", "reasoning": {"effort": "low"}}, "reasoning"),
    ("responses", {"input": "x", "reasoning": {"summary": "auto"}}, "reasoning"),
])
def test_fields_that_would_change_the_answer_if_ignored_are_refused_in_openais_envelope(server, path, body, param):
    """A field that sluice cannot serve is a 400 saying so, never dropped: the client would get an
    answer other than the one it asked for without knowing."""
    response = httpx.post(f"{server.url}/v1/{path}", json={"model": MODEL, "max_tokens": 2, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"], error


def test_fields_that_change_nothing_of_the_answer_are_accepted(client):
    """`prediction` (a hint for speed), `prompt_cache_key` and `safety_identifier` (as `user`),
    `modalities: ["text"]`, `verbosity: "medium"` and `stream_options.include_obfuscation` ask
    for nothing other than what is answered anyway."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3, temperature=0)
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    hinted = client.chat.completions.create(
        **kwargs, prediction={"type": "content", "content": "a guess"}, prompt_cache_key="k", safety_identifier="u",
        modalities=["text"], verbosity="medium")
    assert hinted.choices[0].message.content == plain
    streamed = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_obfuscation": False})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == plain


def test_chat_echo_starts_the_answer_with_the_message_it_continues_unary_and_streamed(client):
    """vLLM's `echo` on a chat: the last message's content (the assistant's, continued) and then
    what was generated, as vLLM answers it; a last message that is the user's is not echoed."""
    messages = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon"}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                  extra_body={"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True})
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    echoed_kwargs = {**kwargs, "extra_body": {**kwargs["extra_body"], "echo": True}}
    echoed = client.chat.completions.create(**echoed_kwargs).choices[0].message.content
    assert echoed == "Once upon" + plain
    chunks = list(client.chat.completions.create(stream=True, **echoed_kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed
    asked = dict(model=MODEL, messages=messages[:1], max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert client.chat.completions.create(**asked).choices[0].message.content == client.chat.completions.create(
        **{**asked, "extra_body": {"ignore_eos": True, "echo": True}}).choices[0].message.content


def test_a_conversation_of_more_messages_than_the_context_has_tokens_is_refused_before_it_is_rendered(server, client):
    """Each message takes at least a token (its role's markers), so 200,000 empty ones cannot fit:
    refused at once, not rendered by the chat template on the worker's event loop (seconds, in
    which the worker answers nothing and the gateway takes it for lost)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": ""}] * 200_000, "max_tokens": 2}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages" and "200000 messages" in response.json()["error"]["message"]
    tokenized = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": body["messages"]}, timeout=120)
    assert tokenized.status_code == 400 and tokenized.json()["error"]["param"] == "messages", tokenized.text
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_a_context_the_prompt_and_output_cannot_fit_names_the_clients_own_field_in_the_message(server):
    """The worker counts the prompt's tokens and says what to reduce: the field the client sent."""
    long = "hi " * 300
    for path, body, field in (
            ("chat/completions", {"messages": [{"role": "user", "content": long}], "max_completion_tokens": 900},
             "max_completion_tokens"),
            ("responses", {"input": long, "max_output_tokens": 900}, "max_output_tokens"),
            ("completions", {"prompt": long, "max_tokens": 900}, "max_tokens")):
        response = httpx.post(f"{server.url}/v1/{path}", json={"model": MODEL, **body}, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == field and error["message"].endswith(f"or {field}."), error


def test_a_chats_store_and_metadata_within_openais_bounds_are_accepted(client):
    metadata = {f"key{i}": "v" * 512 for i in range(16)}
    completion = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                max_tokens=2, store=True, metadata=metadata)
    assert completion.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_character_cut_by_max_tokens_ends_the_text_as_a_replacement_character(client, endpoint):
    """Each of 中's three bytes is a token of its own in this byte-level vocabulary: `max_tokens` 2
    stops inside it. The two tokens generated are text, as decoding their ids gives it: U+FFFD for
    the incomplete character (not nothing), the same unary and streamed."""
    forced = dict(model=MODEL, max_tokens=2, extra_body={"guided_choice": ["中文"]})
    if endpoint == "chat":
        messages = [{"role": "user", "content": "x"}]
        whole = client.chat.completions.create(messages=messages, **forced)
        text = whole.choices[0].message.content
        chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                     stream_options={"include_usage": True}, **forced))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        whole = client.completions.create(prompt="x", **forced)
        text = whole.choices[0].text
        chunks = list(client.completions.create(prompt="x", stream=True, stream_options={"include_usage": True},
                                                **forced))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert whole.usage.completion_tokens == 2 and whole.choices[0].finish_reason == "length"
    assert text == "\ufffd"
    assert streamed == text and chunks[-1].usage.completion_tokens == 2


@pytest.fixture(scope="module")
def reasoner_url(tmp_path_factory):
    """A tiny model whose chat template reads `reasoning_effort`, as gpt-oss's does."""
    from sluice.engines.generative.tiny import CHAT_TEMPLATE
    from sluice.repository import MANIFEST, write_manifest

    repo = write_tiny_lm_model(tmp_path_factory.mktemp("repo"), "reasoner")
    version = repo / "reasoner" / "1"
    config = json.loads((version / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% if reasoning_effort %}Reasoning: {{ reasoning_effort }}\n{% endif %}" + CHAT_TEMPLATE
    (version / "tokenizer_config.json").write_text(json.dumps(config))
    write_manifest(version, version / MANIFEST)
    started = start_server(repo, tmp_path_factory.mktemp("log"))
    yield started.url
    started.stop()


def test_reasoning_effort_reaches_a_chat_template_that_reads_it(reasoner_url):
    with openai.OpenAI(base_url=f"{reasoner_url}/v1", api_key="x", max_retries=0, timeout=60) as sdk:
        messages = [{"role": "user", "content": "x"}]
        plain = sdk.chat.completions.create(model="reasoner", messages=messages, max_tokens=1)
        effortful = sdk.chat.completions.create(model="reasoner", messages=messages, max_tokens=1,
                                                reasoning_effort="high")
        assert effortful.usage.prompt_tokens > plain.usage.prompt_tokens  # "Reasoning: high" was rendered
        response = sdk.responses.create(model="reasoner", input="x", max_output_tokens=1, store=False,
                                        reasoning={"effort": "low"})
        assert response.usage.input_tokens > plain.usage.prompt_tokens and response.reasoning.effort == "low"
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.chat.completions.create(model="reasoner", messages=messages, max_tokens=1,
                                        reasoning_effort="extreme")  # type: ignore[arg-type]
        assert refused.value.body["param"] == "reasoning_effort"

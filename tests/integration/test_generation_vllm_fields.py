"""vLLM's request fields that its users rely on, through a real server with real clients: every
message field a chat template may read reaches it (`name`, an assistant's `reasoning_content`),
`cache_salt` keeps prefix-cache hits apart, `return_token_ids` answers the prompt's and the
output's token ids (unary and streamed), and `request_id` names the response."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import ServerProcess, start_server, write_tiny_lm_model

pytestmark = pytest.mark.slow

MODEL = "named"
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m.name %}{{ m.name }}: {% endif %}"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ '\\n' + m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""The tiny model's chat template, also rendering each message's `name` and an assistant's
reasoning, as multi-user and interleaved-thinking templates do."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    from sluice.repository import MANIFEST, write_manifest

    repo = write_tiny_lm_model(tmp_path_factory.mktemp("repo"), MODEL)
    version = repo / MODEL / "1"
    config = json.loads((version / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (version / "tokenizer_config.json").write_text(json.dumps(config))
    write_manifest(version, version / MANIFEST)
    started = start_server(repo, tmp_path_factory.mktemp("log"))
    yield started
    started.stop()


@pytest.fixture
def client(server: ServerProcess):
    """Fresh answers: a repeated greedy request runs again rather than coming from the result cache."""
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60,
                       default_headers={"Cache-Control": "no-cache"}) as sdk:
        yield sdk


def _tokens(server: ServerProcess, **body: object) -> list[int]:
    answer = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, **body}, timeout=60)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["tokens"])


def test_a_messages_name_and_reasoning_reach_the_chat_template(server, client):
    messages = [{"role": "user", "name": "alice", "content": "Hi"},
                {"role": "assistant", "content": "Hello", "reasoning_content": "greet back"},
                {"role": "user", "name": "bob", "content": "And me?"}]
    expected = ("<|user|>alice: \nHi<|endoftext|>\n<|assistant|><think>greet back</think>\nHello<|endoftext|>\n"
                "<|user|>bob: \nAnd me?<|endoftext|>\n<|assistant|>\n")
    rendered = _tokens(server, messages=messages)
    assert rendered == _tokens(server, prompt=expected, add_special_tokens=False)
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage  # type: ignore[arg-type]
    assert usage.prompt_tokens == len(rendered)
    # vLLM's newer name for the reasoning is read the same
    renamed = [*messages[:1], {"role": "assistant", "content": "Hello", "reasoning": "greet back"}, *messages[2:]]
    assert _tokens(server, messages=renamed) == rendered


def _cached(client: openai.OpenAI, endpoint: str, text: str, salt: str | None) -> int:
    """The prompt tokens a request read from the prefix cache, sent with `cache_salt` (None: none)."""
    extra = {} if salt is None else {"extra_body": {"cache_salt": salt}}
    if endpoint == "completions":
        usage = client.completions.create(model=MODEL, prompt=text, max_tokens=1, **extra).usage  # type: ignore[arg-type]
        return usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    if endpoint == "chat":
        usage = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                               max_tokens=1, **extra).usage  # type: ignore[arg-type]
        return usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    response = client.responses.create(model=MODEL, input=text, max_output_tokens=1, store=False,
                                       **extra)  # type: ignore[arg-type]
    return response.usage.input_tokens_details.cached_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize("endpoint", ["completions", "chat", "responses"])
def test_cache_salt_shares_cached_prompt_blocks_only_between_requests_with_the_same_salt(client, endpoint):
    text = f"{endpoint}: a long system prompt that many requests start with. " * 6  # its own from the start
    assert _cached(client, endpoint, text, "salt-a") == 0  # nobody sent it before
    assert _cached(client, endpoint, text, "salt-b") == 0  # another salt: its blocks are not shared
    assert _cached(client, endpoint, text, None) == 0  # no salt: the tenant's own cache, not salt-a's either
    assert _cached(client, endpoint, text, "salt-a") >= 16  # the same salt: its blocks are
    assert _cached(client, endpoint, text, None) >= 16


@pytest.mark.parametrize("endpoint, salt", [("completions", ""), ("chat/completions", "x" * 5000),
                                            ("responses", 7)])
def test_a_cache_salt_that_is_empty_absurd_or_not_text_is_a_400_naming_it(server, endpoint, salt):
    body: dict[str, object] = {"model": MODEL, "max_tokens": 1, "cache_salt": salt}
    body.update({"completions": {"prompt": "x"}, "chat/completions": {"messages": [{"role": "user", "content": "x"}]},
                 "responses": {"input": "x", "max_tokens": None}}[endpoint])
    answer = httpx.post(f"{server.url}/v1/{endpoint}", json={k: v for k, v in body.items() if v is not None},
                        timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "cache_salt"


def _sse_events(server: ServerProcess, endpoint: str, body: dict[str, object]) -> list[dict[str, object]]:
    with httpx.stream("POST", f"{server.url}/v1/{endpoint}", json={"model": MODEL, **body}, timeout=60) as answer:
        assert answer.status_code == 200, answer.read()
        lines = [line[len("data: "):] for line in answer.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_return_token_ids_on_completions_unary_and_streamed(server, client):
    prompt = "Once upon a time"
    prompt_ids = _tokens(server, prompt=prompt)
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = whole.choices[0].model_extra or {}
    assert choice["prompt_token_ids"] == prompt_ids
    assert len(choice["token_ids"]) == 6 == whole.usage.completion_tokens  # type: ignore[union-attr]
    detokenized = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": choice["token_ids"]},
                             timeout=60).json()["prompt"]
    assert detokenized == whole.choices[0].text
    chunks = _sse_events(server, "completions", {**body, "stream": True})
    choices = [c["choices"][0] for c in chunks if c["choices"]]  # type: ignore[index]
    assert choices[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c for c in choices[1:])  # the first chunk's only
    assert [t for c in choices for t in c["token_ids"]] == choice["token_ids"]
    assert "".join(c["text"] for c in choices) == whole.choices[0].text
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert "token_ids" not in (plain.choices[0].model_extra or {})  # not asked: not sent


def test_return_token_ids_on_chat_unary_and_streamed_with_n_choices(server, client):
    messages = [{"role": "user", "name": "alice", "content": "Say something"}]
    prompt_ids = _tokens(server, messages=messages)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, n=2,  # type: ignore[arg-type]
                                           seed=3, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert (whole.model_extra or {})["prompt_token_ids"] == prompt_ids
    token_ids = [(c.model_extra or {})["token_ids"] for c in whole.choices]
    assert [len(ids) for ids in token_ids] == [5, 5]
    for ids, choice in zip(token_ids, whole.choices, strict=True):
        text = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": ids}, timeout=60).json()
        assert text["prompt"] == choice.message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, n=2, seed=3,  # type: ignore[arg-type]
                                                 stream=True,
                                                 extra_body={"ignore_eos": True, "return_token_ids": True}))
    assert (chunks[0].model_extra or {})["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in (c.model_extra or {}) for c in chunks[1:])
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += (choice.model_extra or {}).get("token_ids") or []
    assert streamed == {0: token_ids[0], 1: token_ids[1]}  # the same seed: the same tokens


def test_return_token_ids_with_echo_and_truncation_reports_what_the_model_read(server):
    prompt = "one two three four five six"
    ids = _tokens(server, prompt=prompt)
    answer = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 3, "return_token_ids": True})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["prompt_token_ids"] == ids[-3:]
    answer = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "return_token_ids": True})
    assert answer.status_code == 200, answer.text
    assert (answer.json()["choices"][0]["prompt_token_ids"], answer.json()["choices"][0]["token_ids"]) == (ids, [])


def test_request_id_names_the_response_as_vllm_names_it(server, client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                          extra_body={"request_id": "rollout-7.step-3"})
    assert chat.id == "chatcmpl-rollout-7.step-3"
    chunks = _sse_events(server, "completions", {"prompt": "x", "max_tokens": 2, "stream": True,
                                                 "request_id": "job:42"})
    assert {c["id"] for c in chunks} == {"cmpl-job:42"}
    # the client's x-request-id, which sluice takes as the request's id, comes first, as in vLLM
    answer = httpx.post(f"{server.url}/v1/completions", headers={"x-request-id": "from-header"}, timeout=60,
                        json={"model": MODEL, "prompt": "x", "max_tokens": 1, "request_id": "from-body"})
    assert (answer.json()["id"], answer.headers["x-request-id"]) == ("cmpl-from-header", "from-header")
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).id.startswith("cmpl-")


@pytest.mark.parametrize("bad", ["", "has spaces", "x" * 129])
def test_a_request_id_that_is_not_an_id_is_a_400_naming_it(server, bad):
    answer = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "request_id": bad})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "request_id"

"""Prefix affinity across workers: with two workers serving one generative model, a prompt that
shares its start with an earlier one goes to the worker that has that start cached."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import metric_total, wait_workers_ready, write_tiny_lm_model

pytestmark = pytest.mark.slow


def test_conversations_return_to_the_worker_that_has_their_prefix_cached(make_server, tmp_path):
    server = make_server(write_tiny_lm_model(tmp_path / "models"), "--workers", "2")
    wait_workers_ready(server.url, 2, model="tiny")
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60,
                        default_headers={"Cache-Control": "no-cache"})
    systems = [f"System prompt number {i}: " + "answer briefly, politely and in plain words. " * 6 for i in range(6)]
    cached: dict[int, list[int]] = {i: [] for i in range(6)}
    for turn in range(3):
        for i, system in enumerate(systems):
            answer = sdk.completions.create(model="tiny", prompt=f"{system}Question {turn}?", max_tokens=2,
                                            temperature=0)
            details = answer.usage.prompt_tokens_details
            cached[i].append(details.cached_tokens if details is not None else 0)
    # a first use computes everything; every later use finds its system prompt cached on its worker
    assert all(hits[0] == 0 for hits in cached.values()), cached
    assert all(hit >= 48 for hits in cached.values() for hit in hits[1:]), cached
    routed = metric_total(server, "sluice_prefix_routed_requests_total", model="tiny", by="prefix")
    assert routed >= 12, httpx.get(f"{server.url}/metrics").text[-2000:]


def test_without_prefix_affinity_generations_route_by_load_alone(make_server, tmp_path):
    server = make_server(write_tiny_lm_model(tmp_path / "models"), "--workers", "2", "--no-prefix-affinity")
    wait_workers_ready(server.url, 2, model="tiny")
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
    for _ in range(4):
        sdk.completions.create(model="tiny", prompt="A shared start, long enough for several blocks. " * 4,
                               max_tokens=1, temperature=0)
    assert metric_total(server, "sluice_prefix_routed_requests_total", model="tiny") == 0


def test_a_prompt_under_another_cache_salt_does_not_follow_the_prefix_and_its_own_salt_does(make_server, tmp_path):
    """The worker salts its prefix cache by tenant and `cache_salt`, so a prompt under a new salt
    finds nothing cached anywhere: it routes by load, not to the worker that has the same text
    under another salt; a later prompt under a salt seen before goes where that salt's went."""
    server = make_server(write_tiny_lm_model(tmp_path / "models"), "--workers", "2")
    wait_workers_ready(server.url, 2, model="tiny")
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60,
                        default_headers={"Cache-Control": "no-cache"})
    system = "A shared system prompt: answer briefly, politely and in plain words. " * 4

    def cached_tokens(salt: str, question: str) -> int:
        answer = sdk.completions.create(model="tiny", prompt=f"{system}{question}", max_tokens=1, temperature=0,
                                        extra_body={"cache_salt": salt})
        details = answer.usage.prompt_tokens_details
        return details.cached_tokens if details is not None else 0

    assert [cached_tokens(f"salt-{i}", "Question?") for i in range(4)] == [0, 0, 0, 0]
    assert metric_total(server, "sluice_prefix_routed_requests_total", model="tiny", by="prefix") == 0
    assert cached_tokens("salt-0", "Another question?") >= 48
    assert metric_total(server, "sluice_prefix_routed_requests_total", model="tiny", by="prefix") == 1

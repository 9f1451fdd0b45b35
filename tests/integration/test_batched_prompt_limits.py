"""A completion with a batch of prompts is one request to its tenant's limits (as OpenAI counts
it), however many generations it runs: it fits a concurrency cap of 1 and takes one request from
the per-minute budget."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from sluice.gateway.tenants import hash_key, new_key
from tests.conftest import ServerProcess, start_server, write_tiny_lm_model

pytestmark = pytest.mark.slow

KEY = new_key()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repo = write_tiny_lm_model(tmp_path_factory.mktemp("repo"), "tiny")
    tenants = repo.parent / "tenants.toml"
    tenants.write_text(f'[tenants.lab]\napi_keys = ["{hash_key(KEY)}"]\nmax_concurrent = 1\nrequests_per_min = 2\n')
    started = start_server(repo, tmp_path_factory.mktemp("log"), "--tenants", str(tenants))
    yield started
    started.stop()


def test_a_batch_of_prompts_is_one_request_to_the_limits(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        batch = client.completions.create(model="tiny", prompt=["one", "two", "three", "four"], max_tokens=4,
                                          temperature=0)
        assert sorted(choice.index for choice in batch.choices) == [0, 1, 2, 3]  # under max_concurrent = 1
        streamed = list(client.completions.create(model="tiny", prompt=[[5, 6], [7, 8, 9]], max_tokens=3,
                                                  stream=True, temperature=0))
        assert {c.choices[0].index for c in streamed if c.choices} == {0, 1}
        with pytest.raises(openai.RateLimitError) as caught:  # two requests a minute: both were used
            client.completions.create(model="tiny", prompt="five", max_tokens=2)
        assert caught.value.body["code"] == "rate_limit_exceeded" or "requests" in str(caught.value)

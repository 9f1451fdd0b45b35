"""Fixtures shared by the integration tests of generation."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.conftest import ServerProcess, start_server, write_tiny_lm_model


@pytest.fixture(scope="module")
def tiny_lm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`sluice serve` of a tiny random-weight Llama named `tiny`, once per test module."""
    repo = write_tiny_lm_model(tmp_path_factory.mktemp("repo"), "tiny")
    started = start_server(repo, tmp_path_factory.mktemp("log"))
    yield started
    started.stop()


@pytest.fixture
def tiny_lm_client(tiny_lm_server: ServerProcess) -> Iterator[openai.OpenAI]:
    """Asks for fresh answers: these tests check the engine, so a greedy request repeated must run
    again rather than come from the result cache (tests/integration/test_cache.py checks that)."""
    with openai.OpenAI(base_url=f"{tiny_lm_server.url}/v1", api_key="x", max_retries=0, timeout=60,
                       default_headers={"Cache-Control": "no-cache"}) as sdk:
        yield sdk

"""A large embeddings request whose inputs take seconds to prepare (tokenize) must not stall the
worker's event loop: that loop sends the reports by which gateways know the worker is alive, so
while it was blocked (2048 texts of 4,000 characters: 4.7 s tokenizing minilm's inputs) the
gateway declared the worker lost, failed the request, killed another model's stream on the same
worker, and answered everything else 503. The emulated model's `prepare_ms_per_kchar` stands in
for the tokenizer, so the cost is seconds without megabytes of text."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.conftest import ServerProcess, write_emulated_model, write_tiny_lm_model

NUM_TEXTS = 64
TEXT_CHARS = 1000
PREPARE_MS_PER_KCHAR = 50.0
"""64,000 characters: 3.2 s to prepare, longer than a gateway waits for a silent worker (2 s)."""


def test_a_request_slow_to_prepare_leaves_the_worker_serving_others(
        tmp_path: Path, make_server: Callable[..., ServerProcess]) -> None:
    repo = tmp_path / "models"
    write_emulated_model(repo, "slowprep", slo_ms=20_000, alpha_ms=1.0, beta_ms=0.1,
                         prepare_ms_per_kchar=PREPARE_MS_PER_KCHAR)
    write_tiny_lm_model(repo, "tiny")
    server = make_server(repo)
    big, stream, smalls = asyncio.run(_converse(server.url))

    assert big.status_code == 200, big.text
    assert len(big.json()["data"]) == NUM_TEXTS
    status, events = stream
    assert status == 200 and events[-1] == "[DONE]"
    assert not any("error" in event for event in events), events[-3:]
    for response, seconds in smalls:
        assert response.status_code == 200, response.text
        assert seconds < 1.0  # answered while the big request was still being prepared
    assert "treating it as lost" not in server.log()


async def _converse(url: str) -> tuple[httpx.Response, tuple[int, list[str]], list[tuple[httpx.Response, float]]]:
    texts = [f"{i:04d} " + "word " * (TEXT_CHARS // 5 - 1) for i in range(NUM_TEXTS)]
    async with httpx.AsyncClient(base_url=url, timeout=60, headers={"Cache-Control": "no-cache"}) as client:
        async def send_big() -> httpx.Response:
            return await client.post("/v1/embeddings", json={"model": "slowprep", "input": texts})

        async def stream_chat() -> tuple[int, list[str]]:
            body = {"model": "tiny", "stream": True, "max_tokens": 48, "temperature": 0,
                    "messages": [{"role": "user", "content": "count"}]}
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                events = [line[5:].strip() async for line in response.aiter_lines() if line.startswith("data:")]
            return response.status_code, events

        async def send_smalls() -> list[tuple[httpx.Response, float]]:
            answers = []
            for i in range(15):
                await asyncio.sleep(0.2)
                started = time.monotonic()
                response = await client.post("/v1/embeddings", json={"model": "slowprep", "input": [f"small {i}"]})
                answers.append((response, time.monotonic() - started))
            return answers

        big = asyncio.create_task(send_big())
        await asyncio.sleep(0.3)  # the big request is being prepared
        stream, smalls = await asyncio.gather(stream_chat(), send_smalls())
        return await big, stream, smalls

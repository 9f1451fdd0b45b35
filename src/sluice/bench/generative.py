"""`sluice bench --endpoint completions|chat`: open-loop streaming load for a generative model.

    calibrate ─> requests (prompt text of ~N tokens, max_tokens M, ignore_eos) ─> for each rate:
        Poisson send times ─> one task per request: POST, stream SSE, time every chunk ─> GenSample
                                                                 └─> genstats.summarize_generation

Prompts are built locally from a word list (no downloads). Their length in tokens comes from
the server itself: a few probe requests of different word counts (`max_tokens` 1, never reused
as benchmark prompts) give, by a least-squares line, the server's tokens per word and the fixed
cost of the request shape (chat template, BOS); each prompt gets the word count that predicts
its target. Word choice makes single prompts deviate from the line by a few percent.
The server's `usage.prompt_tokens` of every request is recorded, so the report shows the
lengths actually served next to the requested ones. Each prompt starts with its own number, so
requests share no prefix and the prefix cache cannot shorten their prefill.

Requests carry `ignore_eos` and `max_tokens` = the drawn output length, so output lengths are
exactly the drawn ones (the server honours `ignore_eos`, as vLLM does).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import numpy as np

from sluice.bench.genstats import GenSample
from sluice.bench.loadgen import poisson_schedule
from sluice.bench.workloads import LengthRange, parse_length, sentences

__all__ = ["Calibration", "GenRequest", "GenWorkload", "LengthRange", "calibrate", "parse_length", "run_rate"]

_START_DELAY_S = 0.05
_PROBE_WORDS = (16, 48, 96, 160, 240)
_WORDS = tuple(sorted({w.strip(".,").lower() for s in sentences(336) for w in s.split()}))


@dataclass(frozen=True, slots=True)
class Calibration:
    """The server's prompt tokens for a text of n words: `fixed_tokens + tokens_per_word * n`."""

    fixed_tokens: float
    tokens_per_word: float

    def words_for(self, num_tokens: int) -> int:
        return max(1, round((num_tokens - self.fixed_tokens) / self.tokens_per_word))


@dataclass(frozen=True, slots=True)
class GenRequest:
    body: bytes
    prompt_len: int
    output_len: int


@dataclass(frozen=True, slots=True)
class GenWorkload:
    """Where and what to send: the endpoint's URL and how to shape a body around a prompt."""

    base_url: str
    model: str
    is_chat: bool
    timeout_ms: float | None = None

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1/{'chat/completions' if self.is_chat else 'completions'}"

    @property
    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.timeout_ms is not None:
            headers["X-Request-Timeout-Ms"] = f"{self.timeout_ms:g}"
        return headers

    def body(self, text: str, max_tokens: int, stream: bool = True) -> bytes:
        doc: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": 0.0,
                               "ignore_eos": True, "stream": stream}
        if stream:
            doc["stream_options"] = {"include_usage": True}
        if self.is_chat:
            doc["messages"] = [{"role": "user", "content": text}]
        else:
            doc["prompt"] = text
        return msgspec.json.encode(doc)

    def requests(self, num: int, prompt: LengthRange, output: LengthRange, calibration: Calibration,
                 seed: int) -> list[GenRequest]:
        rng = random.Random(seed)
        out = []
        for index in range(num):
            prompt_len, output_len = prompt.draw(rng), output.draw(rng)
            text = _text(rng, calibration.words_for(prompt_len), tag=index)
            out.append(GenRequest(self.body(text, output_len), prompt_len, output_len))
        return out


def _text(rng: random.Random, num_words: int, tag: int | None = None) -> str:
    words = [rng.choice(_WORDS) for _ in range(num_words)]
    if tag is not None:
        words[0] = str(tag)
    return " ".join(words)


async def calibrate(session: aiohttp.ClientSession, workload: GenWorkload, seed: int = 12345) -> Calibration:
    """Fit the server's prompt tokens per word from a few probes. Raises `ValueError` when it cannot."""
    rng = random.Random(seed)
    counts = []
    for num_words in _PROBE_WORDS:
        body = workload.body(_text(rng, num_words), max_tokens=1, stream=False)
        async with session.post(workload.url, data=body, headers=workload.headers) as response:
            text = await response.text()
            if response.status != 200:
                raise ValueError(f"POST {workload.url} answered {response.status}: {text[:300]}")
        try:
            counts.append(int(msgspec.json.decode(text)["usage"]["prompt_tokens"]))
        except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"the answer has no usage.prompt_tokens: {text[:300]}") from exc
    per_word, fixed = np.polyfit(np.asarray(_PROBE_WORDS, dtype=np.float64), np.asarray(counts, dtype=np.float64), 1)
    if not per_word > 0:
        raise ValueError(f"prompt tokens did not grow with the prompt ({counts}); cannot size prompts")
    return Calibration(float(fixed), float(per_word))


async def run_rate(session: aiohttp.ClientSession, workload: GenWorkload, requests: list[GenRequest],
                   rate_per_s: float, seed: int, on_done: Callable[[int], None] | None = None) -> list[GenSample]:
    """Send `requests` open-loop at Poisson times of `rate_per_s`; one GenSample per request, in order."""
    rng = np.random.default_rng(seed)
    offsets: np.ndarray = np.empty(0)
    duration_s = max(1.0, len(requests) / rate_per_s)
    while len(offsets) < len(requests):  # enough arrivals for every request
        offsets = poisson_schedule(rate_per_s, duration_s, rng)
        duration_s *= 1.5
    offsets = offsets[:len(requests)]
    start_s = time.perf_counter() + _START_DELAY_S
    tasks: list[asyncio.Task[GenSample]] = []
    num_done = 0

    def done(_: object) -> None:
        nonlocal num_done
        num_done += 1
        if on_done is not None:
            on_done(num_done)

    for offset, request in zip(offsets, requests, strict=True):
        delay_s = start_s + float(offset) - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        task = asyncio.create_task(_stream(session, workload, request, start_s + float(offset)))
        task.add_done_callback(done)
        tasks.append(task)
    samples = await asyncio.gather(*tasks)
    origin = start_s
    return [_shift(s, origin) for s in samples]


def _shift(sample: GenSample, origin: float) -> GenSample:
    """Times relative to the start of the run."""
    return GenSample(sample.scheduled_s - origin, sample.sent_s - origin, sample.status,
                     tuple(t - origin for t in sample.chunk_s), sample.done_s - origin, sample.num_prompt_tokens,
                     sample.num_output_tokens, sample.requested_prompt_len, sample.requested_output_len,
                     sample.error)


async def _stream(session: aiohttp.ClientSession, workload: GenWorkload, request: GenRequest,
                  scheduled_s: float) -> GenSample:
    sent_s = time.perf_counter()
    chunk_s: list[float] = []
    usage: dict[str, Any] | None = None
    status = 0
    error: str | None = None
    try:
        async with session.post(workload.url, data=request.body, headers=workload.headers) as response:
            status = response.status
            if status != 200:
                error = (await response.text())[:300]
            else:
                usage, error = await _read_events(response.content, chunk_s)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
    done_s = time.perf_counter()
    num_prompt = int(usage.get("prompt_tokens", -1)) if usage else -1
    num_output = int(usage.get("completion_tokens", len(chunk_s))) if usage else len(chunk_s)
    return GenSample(scheduled_s, sent_s, status, tuple(chunk_s), done_s, num_prompt, num_output,
                     request.prompt_len, request.output_len, error)


async def _read_events(content: aiohttp.StreamReader, chunk_s: list[float]) -> tuple[dict[str, Any] | None, str | None]:
    """Read SSE `data: ` lines until `[DONE]`, timing each chunk with choices. -> (usage, error)."""
    usage: dict[str, Any] | None = None
    async for line in content:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            return usage, None
        now = time.perf_counter()
        try:
            event = msgspec.json.decode(data)
        except msgspec.DecodeError:
            return usage, f"undecodable event: {data[:100]!r}"
        if not isinstance(event, dict):
            continue
        if "error" in event:
            return usage, str(event["error"])[:300]
        if event.get("choices"):
            chunk_s.append(now)
        if event.get("usage"):
            usage = event["usage"]
    return usage, "the stream ended without data: [DONE]"


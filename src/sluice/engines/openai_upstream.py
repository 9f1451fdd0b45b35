"""`openai-upstream`: an existing OpenAI-compatible server (vLLM, SGLang, TGI, another sluice) as a
worker's device. sluice keeps the gateway, tenancy, deadlines and queueing; the upstream runs
the model.

    GeneratePayload ─▶ one streaming POST {base}/completions or {base}/chat/completions
                       (stream: true, stream_options.include_usage)
                  ◀─ SSE chunks ─▶ TextDelta ... CallEnd(finish_reasons, usage)
                                   or CallFailure (a value, never an exception)

Tool calls: calls asked for (`required`, a named function) are a structured output, so the
upstream gets the tools with `tool_choice: "none"` and the calls' schema as `response_format`.
With `tool_choice: "auto"` the upstream is asked with "auto" and decides (it needs its own tool
call parser, as vLLM's `--tool-call-parser`); the calls it streams back are written into the
relayed text as Hermes blocks, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the
format this runner reports as its models' `tool_call_parser`, which the gateway reads back into
`tool_calls` like any local model's. Thoughts a reasoning model's upstream streams apart
(`reasoning_content`, or `reasoning`) are written the same way, as a `<think>...</think>` block
ahead of the answer, which the gateway reads back apart (`reasoning_parser = "qwen3"`).

Retries: a 5xx, 408/429, connection error, timeout or a stream that breaks is retried with
backoff while nothing has been relayed yet (`RetryConfig`); once text has gone to the client, a
failure ends the call. Any other 4xx is the client's request being refused: final, and its status
reaches the client. 401/403 mean the upstream refused sluice's own key: final, and not the
client's fault. Consecutive failures open the circuit breaker (`sluice.circuit`); while it is open
calls fail at once.

`model.toml`:

    kind = "openai-upstream"
    [upstream]
    url = "http://10.0.0.7:8000/v1"   # the server's OpenAI base URL
    model = "Qwen/Qwen2.5-7B-Instruct" # its name there (default: this model's name)
    api_key_env = "UPSTREAM_KEY"       # optional: the key is read from this environment variable
    max_concurrency = 16               # calls in flight to it in all (`sluice serve --workers N` splits it
                                       # among the workers); the rest wait in the workers
    max_waiting = 1024                 # calls waiting for a slot, beyond which requests are refused
    timeout_s = 600                    # per call; the request's deadline bounds it as well
    max_attempts = 3, backoff_ms = 50, max_backoff_ms = 2000, failure_threshold = 5, open_s = 5.0
    expected_latency_ms = 2000         # one call's duration, before any was measured
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from sluice import wire
from sluice.circuit import CircuitBreaker
from sluice.clock import MonotonicClock
from sluice.engines.base import Share, share_of
from sluice.engines.retry import RETRYABLE_4XX, RetryConfig, parse_retry
from sluice.errors import ConfigError
from sluice.repository import ModelVersion

if TYPE_CHECKING:  # imported when a session opens: a worker serving no upstream starts without it
    import aiohttp

__all__ = ["CallEnd", "CallFailure", "OpenAIUpstreamConfig", "OpenAIUpstreamRunner", "TextDelta", "parse_config",
           "request_for"]

_CREDENTIAL_STATUSES = frozenset({401, 403})


@dataclass(frozen=True, slots=True)
class OpenAIUpstreamConfig:
    base_url: str
    model: str
    api_key: str | None = None
    max_concurrency: int = 8
    max_waiting: int = 1024
    timeout_s: float = 600.0
    expected_latency_s: float = 2.0
    retry: RetryConfig = field(default_factory=RetryConfig)


def parse_config(version: ModelVersion) -> OpenAIUpstreamConfig:
    """Read `[upstream]`; ConfigError naming the model for anything missing or out of range. The
    API key is read from the environment here, once, and never from the file."""
    where = f"{version.name} v{version.version}: [upstream]"
    settings = dict(version.upstream)
    url = settings.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(f"{where}: url must be an http(s) URL such as http://host:8000/v1")
    api_key = None
    if "api_key" in settings:
        raise ConfigError(f"{where}: put the key in an environment variable and name it with api_key_env")
    if (env := settings.get("api_key_env")) is not None:
        api_key = os.environ.get(str(env))
        if not api_key:
            raise ConfigError(f"{where}: environment variable {env} (api_key_env) is not set")
    try:
        config = OpenAIUpstreamConfig(
            base_url=url.rstrip("/"), model=str(settings.get("model", version.name)), api_key=api_key,
            max_concurrency=int(settings.get("max_concurrency", 8)),
            max_waiting=int(settings.get("max_waiting", 1024)),
            timeout_s=float(settings.get("timeout_s", 600.0)),
            expected_latency_s=float(settings.get("expected_latency_ms", 2000)) / 1000,
            retry=parse_retry(settings, where),
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    if config.max_concurrency < 1 or config.max_waiting < 0:
        raise ConfigError(f"{where}: max_concurrency must be at least 1 and max_waiting at least 0")
    if not config.timeout_s > 0 or not config.expected_latency_s > 0:
        raise ConfigError(f"{where}: timeout_s and expected_latency_ms must be positive")
    return config


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str
    logprobs: tuple[wire.TokenLogprob, ...] = ()
    """The delta's tokens' log-probabilities, when they were asked for (token ids unknown: -1)."""
    index: int = 0
    """The choice it is of (n > 1)."""


@dataclass(frozen=True, slots=True)
class CallEnd:
    finish_reasons: tuple[str, ...]
    """Every choice's, by index (one unless the request asked for n > 1)."""
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    num_reasoning_tokens: int = 0
    """As the upstream counted them (`completion_tokens_details`); 0 if it did not say."""
    num_cache_write_tokens: int | None = None
    """As the upstream counted them (`prompt_tokens_details`); None if it did not say."""


@dataclass(frozen=True, slots=True)
class CallFailure:
    message: str
    status: int = 0
    """The upstream refused the client's request with this 4xx (final; the client sees it); 0 otherwise."""
    param: str | None = None
    is_retryable: bool = False
    """Worth another attempt if nothing has been relayed yet (5xx, 408/429, connection, timeout)."""
    retry_after_s: float | None = None
    is_timeout: bool = False
    """The call got no complete answer within its time."""
    is_deadline: bool = False
    """The request's own deadline ended it (a 504 for the client, not the upstream's failure)."""


CallEvent = TextDelta | CallEnd | CallFailure


def request_for(config: OpenAIUpstreamConfig, payload: wire.GeneratePayload) -> tuple[str, dict[str, Any]]:
    """The URL and JSON body of the streaming call for `payload`. Chat messages go as messages,
    so the upstream applies its own chat template; sluice-only sampling fields are sent only when
    set, so a strict server (OpenAI itself) is not handed fields it does not know."""
    body: dict[str, Any] = {"model": config.model, "stream": True, "stream_options": {"include_usage": True},
                            "max_tokens": payload.max_tokens, "temperature": payload.temperature,
                            "top_p": payload.top_p}
    optional = {"n": payload.n if payload.n > 1 else None, "seed": payload.seed, "stop": payload.stop or None,
                "top_k": payload.top_k or None, "min_p": payload.min_p or None,
                "min_tokens": payload.min_tokens or None, "stop_token_ids": payload.stop_token_ids or None,
                "ignore_eos": payload.ignore_eos or None,
                "skip_special_tokens": None if payload.skip_special_tokens else False,
                "include_stop_str_in_output": payload.include_stop_str_in_output or None,
                "truncate_prompt_tokens": payload.truncate_prompt_tokens or None,
                "repetition_penalty": None if payload.repetition_penalty == 1.0 else payload.repetition_penalty,
                "presence_penalty": payload.presence_penalty or None,
                "frequency_penalty": payload.frequency_penalty or None,
                "logit_bias": {str(token): bias for token, bias in payload.logit_bias.items()} or None,
                "cache_salt": payload.cache_salt or None}
    body.update({key: value for key, value in optional.items() if value is not None})
    if payload.output_format is not None:
        body.update(_structured_fields(payload.output_format))
    if payload.messages is not None:
        body["messages"] = [_message(m) for m in payload.messages]
        if payload.tools:  # calls asked for come back as structured output (above); "auto": see the module
            body.update(tools=[_tool(t) for t in payload.tools], tool_choice="auto" if payload.tools_auto else "none")
        if payload.logprobs is not None:
            body.update(logprobs=True, top_logprobs=payload.logprobs)
        if payload.reasoning_effort is not None:  # the upstream decides, and refuses it for a model that cannot
            body["reasoning_effort"] = payload.reasoning_effort
        if payload.template is not None:  # vLLM's fields, sent only when the client set them
            body.update(add_generation_prompt=payload.template.add_generation_prompt,
                        continue_final_message=payload.template.continue_final_message)
            if payload.template.kwargs:
                body["chat_template_kwargs"] = payload.template.kwargs
        return f"{config.base_url}/chat/completions", body
    if payload.logprobs is not None:
        body["logprobs"] = payload.logprobs
    body["prompt"] = payload.prompt_token_ids if payload.prompt_token_ids is not None else payload.prompt or ""
    return f"{config.base_url}/completions", body


def _message(message: wire.ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _tool(tool: wire.ToolSpec) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters:
        function["parameters"] = json.loads(tool.parameters)
    return {"type": "function", "function": function}


def _structured_fields(output_format: wire.OutputFormat) -> dict[str, Any]:
    """A structured output as the upstream takes it: OpenAI's `response_format` for JSON, vLLM's
    `structured_outputs` for the rest (a server that knows neither refuses or ignores them)."""
    if output_format.kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if output_format.kind == "json_schema":
        schema = json.loads(output_format.spec)
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}}
    value: Any = json.loads(output_format.spec) if output_format.kind == "choice" else output_format.spec
    return {"structured_outputs": {output_format.kind: value}}


class OpenAIUpstreamRunner:
    """Constructed in the worker before its event loop runs; `start()` opens the connection pool
    on the loop. The breaker and the jitter source are used from that loop only."""

    def __init__(self, version: ModelVersion, device: str, share: Share = (0, 1)) -> None:
        config = parse_config(version)
        self.config = replace(config, max_concurrency=share_of(config.max_concurrency, share))
        self.device = device
        self.breaker = CircuitBreaker(self.config.retry.circuit, MonotonicClock())
        self.info = wire.ModelInfo(
            name=version.name, version=version.version, kind="openai-upstream", platform=version.platform,
            inputs=(wire.TensorSpec("text_input", "BYTES", (-1,)),),
            outputs=(wire.TensorSpec("text_output", "BYTES", (-1,)),),
            max_batch_size=self.config.max_concurrency, slo_s=version.slo_s, accepts_text=False,
            accepts_tensor=False,
            cache_revision=version.cache_revision, tool_call_parser="hermes", reasoning_parser="qwen3",
            takes_reasoning_effort=True,
        )
        self._rng = random.Random()
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        import aiohttp

        limit = self.config.max_concurrency
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, limit_per_host=limit))

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    def close(self) -> None:
        """The worker's synchronous close: the session is closed by `aclose` on the loop."""

    async def generate(self, payload: wire.GeneratePayload, timeout_s: float,
                       trace: wire.TraceContext | None = None) -> AsyncGenerator[CallEvent, None]:
        """Stream one generation: `TextDelta`s, then a `CallEnd` or a `CallFailure`. Retries what is
        retryable until text has been relayed, within `timeout_s` (the request's remaining time).
        `trace`: the W3C trace context each call carries (`traceparent`, `tracestate`)."""
        loop_time = _LoopTime()
        url, body = request_for(self.config, payload)
        data = json.dumps(body).encode()
        retry = self.config.retry
        failure = CallFailure("no attempt was made", is_retryable=True)
        for attempt in range(1, retry.max_attempts + 1):
            remaining_s = timeout_s - loop_time.elapsed_s()
            if remaining_s <= 0:
                yield CallFailure(f"the deadline passed before the upstream finished; last error: {failure.message}",
                                  is_deadline=True)
                return
            if not self.breaker.allow():
                yield CallFailure(f"upstream unavailable: circuit open after repeated failures (next trial in "
                                  f"{self.breaker.retry_after_s():.1f} s); last error: {failure.message}",
                                  retry_after_s=max(self.breaker.retry_after_s(), 0.1))
                return
            num_relayed = 0
            is_deadline_bound = remaining_s <= self.config.timeout_s
            attempt_s = min(remaining_s, self.config.timeout_s)
            async with aclosing(self._attempt(url, data, attempt_s, trace)) as events:
                async for event in events:
                    if isinstance(event, CallFailure) and event.is_timeout and is_deadline_bound:
                        yield CallFailure("the deadline passed before the upstream finished", is_deadline=True)
                        return
                    if isinstance(event, CallFailure) and event.is_retryable and num_relayed == 0:
                        failure = event
                        break
                    num_relayed += isinstance(event, TextDelta)
                    yield event
                else:
                    return
            if attempt < retry.max_attempts:
                delay_s = retry.delay_s(attempt, self._rng)
                await asyncio.sleep(min(delay_s, max(timeout_s - loop_time.elapsed_s(), 0.0)))
        yield CallFailure(f"upstream failed after {retry.max_attempts} attempts: {failure.message}",
                          is_retryable=True)

    async def _attempt(self, url: str, data: bytes, timeout_s: float,
                       trace: wire.TraceContext | None = None) -> AsyncGenerator[CallEvent, None]:
        """One call, its outcome recorded with the breaker whatever way it ends (even cancelled),
        so that a half-open breaker never waits forever for its trial."""
        is_upstream_ok = False
        try:
            async with aclosing(self._post(url, data, timeout_s, trace)) as events:
                async for event in events:
                    if isinstance(event, CallEnd) or (isinstance(event, CallFailure) and not event.is_retryable):
                        is_upstream_ok = True
                    yield event
        finally:
            if is_upstream_ok:
                self.breaker.record_success()
            else:
                self.breaker.record_failure()

    async def _post(self, url: str, data: bytes, timeout_s: float,
                    trace: wire.TraceContext | None = None) -> AsyncGenerator[CallEvent, None]:
        import aiohttp

        assert self._session is not None, "start() opens the session"
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream",
                   "X-Request-Timeout-Ms": str(max(int(timeout_s * 1000), 1))}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        if trace is not None:
            headers.update(trace.headers())
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self._session.post(url, data=data, headers=headers, timeout=timeout) as response:
                if response.status >= 400:
                    yield _refusal(response.status, await response.text(errors="replace"))
                    return
                try:
                    async with aclosing(_relay(response)) as events:
                        async for event in events:
                            yield event
                finally:
                    if not response.content.at_eof():
                        response.close()  # stopped early (cancelled, deadline): close the upstream stream
        except TimeoutError:
            yield CallFailure(f"no complete answer within {timeout_s:.1f} s", is_retryable=True, is_timeout=True)
        except aiohttp.ClientError as exc:
            yield CallFailure(f"connection error: {type(exc).__name__}: {exc}", is_retryable=True)


async def _relay(response: aiohttp.ClientResponse) -> AsyncGenerator[CallEvent, None]:
    """An OpenAI SSE stream as events: text deltas, then its end with the usage it reported."""
    finish_reasons: dict[int, str] = {}
    usage: dict[str, Any] | None = None
    num_deltas = 0
    calls, thoughts = _CallsAsText(), _ThoughtsAsText()
    async for raw in response.content:
        line = raw.decode("utf-8", errors="replace").strip()
        if not line.startswith("data:"):
            continue  # blank separators, comments, event names
        data = line[5:].strip()
        if data == "[DONE]":
            break
        try:
            chunk = json.loads(data)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than json decodes
            yield CallFailure(f"upstream sent an undecodable event: {data[:100]!r}", is_retryable=True)
            return
        if not isinstance(chunk, dict):
            continue
        if "error" in chunk:
            yield CallFailure(f"upstream error: {_error_message(chunk)}", is_retryable=True)
            return
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            text = choice.get("text") if "text" in choice else delta.get("content")
            logprobs = _logprobs(choice.get("logprobs"))
            index = choice.get("index", 0)
            if not isinstance(index, int) or not 0 <= index < wire.MAX_CHOICES:
                continue  # not a choice this request can have asked for
            answer = (text or "") + calls.write(index, delta.get("tool_calls"))
            text = thoughts.write(index, delta.get("reasoning_content") or delta.get("reasoning"), answer)
            if choice.get("finish_reason"):
                text += thoughts.close(index) + calls.close(index)
                reason = str(choice["finish_reason"])
                finish_reasons[index] = "stop" if reason == "tool_calls" else reason  # the gateway says tool_calls
            if text or logprobs:
                num_deltas += 1
                yield TextDelta(text, logprobs, index)
    if not finish_reasons:
        yield CallFailure("upstream stream ended without a finish_reason", is_retryable=True)
        return
    yield _end(finish_reasons, usage, num_deltas)


class _ThoughtsAsText:
    """An upstream's streamed thoughts (`reasoning_content`, or vLLM's newer `reasoning`) written
    as a `<think>` block ahead of the answer, choice by choice, as Qwen3 writes them: the gateway
    reads them back apart (`sluice.reasoning`, this runner's `reasoning_parser`)."""

    def __init__(self) -> None:
        self._started: dict[int, bool] = {}  # choice -> still thinking (False: its answer has begun)

    def write(self, choice: int, thought: Any, answer: str) -> str:
        out = []
        if isinstance(thought, str) and thought:
            if choice not in self._started:
                self._started[choice] = True
                out.append("<think>")
            if self._started[choice]:  # (thoughts after the answer began cannot go before it: not shown)
                out.append(thought)
        if answer:
            out.append(self.close(choice) + answer)
            self._started[choice] = False
        return "".join(out)

    def close(self, choice: int) -> str:
        """The block's end, if it is open."""
        if self._started.get(choice):
            self._started[choice] = False
            return "</think>"
        return ""


class _CallsAsText:
    """An upstream's streamed `tool_calls` written as Hermes blocks, choice by choice: a call's
    first delta names it, the next ones add to its arguments (a JSON object, in pieces)."""

    def __init__(self) -> None:
        self._open: dict[int, tuple[int, bool]] = {}  # choice -> (the call being written, any arguments yet)

    def write(self, choice: int, deltas: Any) -> str:
        out = []
        for delta in deltas if isinstance(deltas, list) else ():
            if not isinstance(delta, dict):
                continue
            function = delta.get("function")
            if not isinstance(function, dict):
                function = {}
            at, arguments = delta.get("index", 0), str(function.get("arguments") or "")
            if choice not in self._open or self._open[choice][0] != at:
                out.append(self.close(choice))
                out.append(f'<tool_call>{{"name": {json.dumps(str(function.get("name") or ""))}, "arguments": ')
                self._open[choice] = (at, False)
            out.append(arguments)
            self._open[choice] = (at, self._open[choice][1] or bool(arguments.strip()))
        return "".join(out)

    def close(self, choice: int) -> str:
        if choice not in self._open:
            return ""
        _, has_arguments = self._open.pop(choice)
        return ("" if has_arguments else "{}") + "}</tool_call>"


def _token_bytes(entry: dict[str, Any]) -> bytes | None:
    """A chat log-probability's `bytes` where they are not its token's text (part of a character);
    None where they are, or are not a list of bytes."""
    given = entry.get("bytes")
    try:
        raw = bytes(given) if isinstance(given, list) else b""
    except (TypeError, ValueError):
        return None
    return raw if raw and raw != str(entry["token"]).encode() else None


def _logprobs(reported: Any) -> tuple[wire.TokenLogprob, ...]:
    """A choice's `logprobs`, in either endpoint's shape, as sluice's; () if absent or malformed
    (text is still relayed: log-probabilities are an addition to it)."""
    try:
        if not isinstance(reported, dict):
            return ()
        if isinstance(reported.get("content"), list):  # chat
            return tuple(wire.TokenLogprob(str(entry["token"]), -1, float(entry["logprob"]),
                                           [wire.TopLogprob(str(top["token"]), -1, float(top["logprob"]),
                                                            _token_bytes(top))
                                            for top in entry.get("top_logprobs") or ()], _token_bytes(entry))
                         for entry in reported["content"])
        tokens, values = reported.get("tokens") or [], reported.get("token_logprobs") or []
        tops = reported.get("top_logprobs") or [None] * len(tokens)
        return tuple(wire.TokenLogprob(str(token), -1, float(value),
                                       [wire.TopLogprob(str(t), -1, float(v))
                                        for t, v in sorted((top or {}).items(), key=lambda kv: -kv[1])])
                     for token, value, top in zip(tokens, values, tops, strict=True))
    except (KeyError, TypeError, ValueError, AttributeError):
        return ()


def _end(finish_reasons: dict[int, str], usage: dict[str, Any] | None, num_deltas: int) -> CallEnd:
    """Usage as the upstream counted it; without it, one token per delta and an unknown prompt (0)."""
    reasons = tuple(finish_reasons.get(i, "stop") for i in range(max(finish_reasons) + 1))
    if not usage:
        return CallEnd(reasons, 0, 0, num_deltas)
    details = usage.get("prompt_tokens_details") or {}
    output_details = usage.get("completion_tokens_details") or {}
    writes = details.get("cache_write_tokens")
    return CallEnd(reasons, int(usage.get("prompt_tokens") or 0), int(details.get("cached_tokens") or 0),
                   int(usage.get("completion_tokens") or 0), int(output_details.get("reasoning_tokens") or 0),
                   None if writes is None else int(writes))


def _refusal(status: int, text: str) -> CallFailure:
    """An HTTP error status before the stream: retryable, the upstream's credentials, or the client's."""
    message = _error_message(_json_or_none(text)) or text[:300]
    if status >= 500 or status in RETRYABLE_4XX:
        return CallFailure(f"HTTP {status}: {message}", is_retryable=True)
    if status in _CREDENTIAL_STATUSES:
        return CallFailure(f"the upstream refused sluice's credentials (HTTP {status}): {message}")
    param = _error_field(_json_or_none(text), "param")
    return CallFailure(message, status=status, param=param if isinstance(param, str) else None)


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _error_message(body: Any) -> str:
    message = _error_field(body, "message")
    return message if isinstance(message, str) else ""


def _error_field(body: Any, name: str) -> Any:
    """A field of OpenAI's `{"error": {...}}` envelope, or of the flat `{"object": "error", ...}` shape."""
    if not isinstance(body, dict):
        return None
    inner = body.get("error")
    return inner.get(name) if isinstance(inner, dict) else body.get(name)


class _LoopTime:
    def __init__(self) -> None:
        self._clock = MonotonicClock()
        self._started = self._clock.now()

    def elapsed_s(self) -> float:
        return self._clock.now() - self._started


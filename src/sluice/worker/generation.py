"""A generative model's engine, stepped on its own thread while it has sequences.

    loop thread                               generation thread
    ───────────                               ─────────────────
    submit() ─▶ engine.add_request ──(inbox)──▶ step() ─▶ step() ─▶ ... (until nothing is left)
    abort()  ─▶ engine.abort ───────(inbox)──▶   freed within one step
    on_outputs(outputs, step_s, tokens) ◀── call_soon_threadsafe, once per step that computed something
                                              (a sequence that fails ends alone with "error")

The engine does continuous batching itself: a request joins the running batch at the next step
and leaves it the step it finishes, so this thread only has to keep stepping. `Generations` is the
loop thread's side: where each request's output goes (chunks, `Started`, the final `Result`).
A prompt over `OFF_LOOP_PROMPT_CHARS` is tokenized on a worker thread, so that no request stalls
the event loop that serves every other one (and answers the gateway's liveness checks).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from sluice import wire
from sluice.clock import Clock
from sluice.engines.device_gate import DEVICE_GATE
from sluice.engines.generative.tokenizer import prompt_chars
from sluice.errors import InvalidInput
from sluice.priority import Priority, priority_from_wire
from sluice.reasoning import ThoughtTokens, request_parser

if TYPE_CHECKING:  # the engine brings torch: imported once a generative model is loaded (engines.load_runner)
    from sluice.engines.generative.engine import RequestOutput
    from sluice.engines.generative.runner import GenerativeRunner, PreparedGeneration
    from sluice.engines.generative.sequence import TokenLogprobs
    from sluice.engines.generative.tokenizer import Tokenizer

log = logging.getLogger("sluice.worker")

OnOutputs = Callable[[list["RequestOutput"], float, dict[str, int]], None]
"""(a step's outputs, its seconds, the tokens it computed for each sequence)"""

RefusedWork = Callable[[str, str, float], None]
"""(model, version, predicted device-seconds) of a generation refused for overload"""

OFF_LOOP_PROMPT_CHARS = 16_384
"""Longer prompts (more than a few ms to tokenize) are prepared on a thread, off the event loop;
so is every request for a structured output (compiling its grammar can take as long)."""


class GenerationLoop:
    def __init__(self, runner: GenerativeRunner, on_outputs: OnOutputs, loop: asyncio.AbstractEventLoop) -> None:
        self.runner = runner
        self._engine = runner.engine
        self._on_outputs = on_outputs
        self._loop = loop
        self._wake = threading.Event()
        self._is_stopping = False
        self._thread = threading.Thread(target=self._run, name=f"generate-{runner.info.name}", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prepared: PreparedGeneration, priority: Priority, deadline: float,
               salt: str, prefix_of: str | None = None, cache_salt: str = "") -> None:
        """Queue a sequence; `InvalidInput` for one the engine cannot serve (too long, bad ids).
        `prefix_of`: a sequence queued before with the same prompt, whose prompt this one shares."""
        try:
            self._engine.add_request(request_id, prepared.prompt_token_ids, prepared.params, priority=priority,
                                     deadline=deadline, salt=salt, prefix_of=prefix_of, matcher=prepared.matcher,
                                     cache_salt=cache_salt)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from exc
        self._wake.set()

    def abort(self, request_ids: list[str]) -> None:
        self._engine.abort(request_ids)
        self._wake.set()

    def set_tenant_weights(self, weights: dict[str, float]) -> None:
        """The tenants' fair-share weights for the engine's scheduler; ValueError for a bad one."""
        self._engine.set_tenant_weights(weights)

    def stop(self) -> None:
        self._is_stopping = True
        self._wake.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._is_stopping:
            self._wake.wait()
            self._wake.clear()
            while not self._is_stopping and self._engine.has_unfinished():
                started = time.perf_counter()
                outputs = self._step()
                if outputs is None:
                    break  # the engine cannot even end its sequences: wait for the next request
                tokens = self._engine.last_step_tokens
                if outputs or tokens:
                    self._loop.call_soon_threadsafe(self._on_outputs, outputs, time.perf_counter() - started, tokens)

    def _step(self) -> list[RequestOutput] | None:
        """One engine step. The engine ends a failing sequence by itself; should the step still
        raise (a scheduler bug), every sequence ends with an error and the loop goes on serving."""
        try:
            with DEVICE_GATE.shared():
                return self._engine.step()
        except Exception:
            log.exception("generation step failed; ending this model's sequences with an error")
        try:
            return self._engine.fail_all()
        except Exception:
            log.exception("ending this model's sequences after a failed step failed too")
            return None


@dataclass(slots=True)
class _Choice:
    """One of a request's n sequences."""

    parts: list[str] = field(default_factory=list)
    """An unstreamed generation's text so far."""
    logprobs: list[wire.TokenLogprob] | None = None
    """An unstreamed generation's log-probabilities so far, if it asked for them."""
    token_ids: list[int] | None = None
    """An unstreamed generation's output token ids so far, if it asked for them (`return_token_ids`)."""
    num_output_tokens: int = 0
    num_cache_write_tokens: int = 0
    """Its prompt tokens it wrote to the prefix cache (the first choice writes what the others read)."""
    finish_reason: str | None = None
    thoughts: ThoughtTokens | None = None
    """A reasoning model's chat: how many of its tokens are thought (`sluice.reasoning`)."""


@dataclass(slots=True)
class _Generation:
    """A generation in the engine (n sequences for n choices): where its output goes."""

    identity: bytes
    gateway_request_id: int
    loop: GenerationLoop
    is_streamed: bool
    key: tuple[str, str]
    max_tokens: int = 0
    choices: list[_Choice] = field(default_factory=lambda: [_Choice()])
    echo_prompt_ids: list[int] | None = None
    """The prompt to echo with the first token (`echo`); None once echoed, or if not asked."""
    prompt: wire.EchoedPrompt | None = None
    """An unstreamed generation's echoed prompt."""
    prompt_token_ids: list[int] | None = None
    """The prompt's token ids, if asked (`return_token_ids`): a stream's first chunk carries them
    (None once sent), an unstreamed answer's result."""
    is_prompt_only: bool = False
    device_s: float = 0.0
    batch_size: int = 0
    """The most sequences an engine step that computed one of its own held (the span's batch size)."""
    is_started: bool = False
    output_format: wire.OutputFormat | None = None
    """Its structured output, named in the refusal should its grammar prove unusable as it runs."""


class _RecentCost:
    """What one model's generations have recently cost, to price one that was refused: device
    seconds per computed token (each step's time over the tokens it computed, as `device_s` is
    charged), and the share of `max_tokens` that finished generations used (a stop string or
    the end-of-sequence token usually ends one sooner). Both decay over the last few hundred
    steps and generations."""

    DECAY = 0.99

    def __init__(self) -> None:
        self._seconds = 0.0
        self._tokens = 0.0
        self._used = 0.0
        self._allowed = 0.0

    def step(self, seconds: float, num_tokens: int) -> None:
        self._seconds = self._seconds * self.DECAY + seconds
        self._tokens = self._tokens * self.DECAY + num_tokens

    def finished(self, num_output_tokens: int, max_tokens: int) -> None:
        self._used = self._used * self.DECAY + min(num_output_tokens, max_tokens)
        self._allowed = self._allowed * self.DECAY + max_tokens

    def predicted_s(self, num_prompt_tokens: int, max_tokens: int) -> float:
        """The device time a generation of this size would have used (0 before any step)."""
        if self._tokens <= 0:
            return 0.0
        share = self._used / self._allowed if self._allowed > 0 else 1.0
        return self._seconds / self._tokens * (num_prompt_tokens + share * max_tokens)


class Generations:
    """The worker's generation requests, by internal id: submitted to their model's loop, streamed
    back as `TokenChunk`s (or collected, unstreamed), answered with one `Result` when they end.
    `forget(identity, gateway_request_id)` is called when one has been answered; `refused_work`
    with the predicted device time of each one the engine refused for overload."""

    def __init__(self, clock: Clock, reply: wire.Reply, forget: Callable[[bytes, int], None],
                 refused_work: RefusedWork | None = None) -> None:
        self._clock = clock
        self._reply = reply
        self._forget = forget
        self._refused_work = refused_work
        self._by_id: dict[int, _Generation] = {}
        self._costs: dict[tuple[str, str], _RecentCost] = {}
        self._preparing: set[asyncio.Task[None]] = set()  # held so they are not collected mid-flight

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def holds(self, key: tuple[str, str]) -> bool:
        """Whether a generation of this model version is unanswered."""
        return any(generation.key == key for generation in self._by_id.values())

    def submit(self, internal_id: int, identity: bytes, message: wire.Submit, loop: GenerationLoop) -> bool:
        """Queue it on `loop`; False (and the request answered with its error) if it cannot run.
        A large prompt is prepared on a thread: then True, and a failure is answered later."""
        payload = message.payload
        deadline = self._clock.now() + message.timeout_s
        if isinstance(payload, wire.TokenizePayload):
            self._tokenize(identity, message.request_id, payload, loop.runner)
            return False
        if not isinstance(payload, wire.GeneratePayload):
            error = InvalidInput(f"model {message.model} generates text: use /v1/completions, /v1/chat/completions or "
                                 "KServe infer over HTTP with a text_input")
            self._refuse(identity, message.request_id, error)
            return False
        generation = _Generation(identity, message.request_id, loop, payload.stream, (message.model, message.version),
                                 output_format=payload.output_format)
        self._by_id[internal_id] = generation
        if prompt_chars(payload) > OFF_LOOP_PROMPT_CHARS or payload.output_format is not None:
            task = asyncio.create_task(self._prepare_off_loop(internal_id, generation, message, deadline))
            self._preparing.add(task)
            task.add_done_callback(self._preparing.discard)
            return True
        try:
            self._enqueue(internal_id, generation, message, loop.runner.prepare(payload), deadline)
        except InvalidInput as exc:
            del self._by_id[internal_id]
            self._refuse(identity, message.request_id, exc)
            return False
        except Exception:  # a bug in preparing one request: answer it, and never leave it registered
            log.exception("preparing generation request %d failed", message.request_id)
            del self._by_id[internal_id]
            self._reply(identity, _failure(message.request_id, 0, 0.0))
            return False
        return True

    async def _prepare_off_loop(self, internal_id: int, generation: _Generation, message: wire.Submit,
                                deadline: float) -> None:
        assert isinstance(message.payload, wire.GeneratePayload)
        try:
            prepared = await asyncio.to_thread(generation.loop.runner.prepare, message.payload)
            if self._by_id.get(internal_id) is generation:  # not withdrawn meanwhile
                self._enqueue(internal_id, generation, message, prepared, deadline)
        except InvalidInput as exc:
            if self._by_id.pop(internal_id, None) is generation:
                self._forget(generation.identity, generation.gateway_request_id)
                self._refuse(generation.identity, generation.gateway_request_id, exc)
        except Exception:  # a bug in preparing one request: answer it, keep serving the rest
            log.exception("preparing generation request %d failed", message.request_id)
            if self._by_id.pop(internal_id, None) is generation:
                self._forget(generation.identity, generation.gateway_request_id)
                self._reply(generation.identity, _failure(generation.gateway_request_id, 0, 0.0))

    def _enqueue(self, internal_id: int, generation: _Generation, message: wire.Submit, prepared: PreparedGeneration,
                 deadline: float) -> None:
        """Queue its n sequences; if the engine refuses one, none stays queued."""
        payload = message.payload
        assert isinstance(payload, wire.GeneratePayload)
        generation.max_tokens = prepared.params.max_tokens
        generation.is_prompt_only = prepared.is_prompt_only
        generation.choices = [_Choice() for _ in range(payload.n)]
        parser = request_parser(generation.loop.runner.info.reasoning_parser, payload)
        if parser:  # (as the gateway reads the answer: `api.completion_shapes`)
            for choice in generation.choices:
                choice.thoughts = ThoughtTokens(parser)
        if payload.echo:
            generation.echo_prompt_ids = prepared.prompt_token_ids
        if payload.return_token_ids:
            generation.prompt_token_ids = list(prepared.prompt_token_ids)
            for choice in generation.choices:
                choice.token_ids = []
        choices = [_choice_of(prepared, index) for index in range(payload.n)]
        for index in range(payload.n):
            try:
                generation.loop.submit(_engine_id(internal_id, index), choices[index],
                                       priority_from_wire(message.priority), deadline, salt=message.tenant,
                                       prefix_of=_engine_id(internal_id, 0) if index else None,
                                       cache_salt=payload.cache_salt)
            except Exception:
                generation.loop.abort([_engine_id(internal_id, i) for i in range(index)])
                raise

    def _tokenize(self, identity: bytes, request_id: int, payload: wire.TokenizePayload,
                  runner: GenerativeRunner) -> None:
        """Answer a tokenizer request at once (the engine is not involved); a long text on a thread."""
        if prompt_chars(payload) <= OFF_LOOP_PROMPT_CHARS:
            self._answer_tokenized(identity, request_id, _outcome(runner, payload))
            return

        async def off_loop() -> None:
            self._answer_tokenized(identity, request_id, await asyncio.to_thread(_outcome, runner, payload))

        task = asyncio.create_task(off_loop())
        self._preparing.add(task)
        task.add_done_callback(self._preparing.discard)

    def _answer_tokenized(self, identity: bytes, request_id: int, outcome: wire.TokenizeResult | Exception) -> None:
        if isinstance(outcome, InvalidInput):
            self._refuse(identity, request_id, outcome)
        elif isinstance(outcome, Exception):
            self._reply(identity, _failure(request_id, 0, 0.0))
        else:
            self._reply(identity, wire.Result(request_id, wire.Outcome.OK, payload=outcome))

    def _refuse(self, identity: bytes, request_id: int, error: InvalidInput) -> None:
        """Answer a request the engine cannot serve (400, naming the field where known)."""
        self._reply(identity, wire.Result(request_id, wire.Outcome.FAILED, message=error.message,
                                          errors=[wire.ItemError(-1, error.message, param=error.param)]))

    def cancel(self, internal_id: int) -> bool:
        """Withdraw it (its blocks are freed within one step); False if it is not a generation."""
        generation = self._by_id.pop(internal_id, None)
        if generation is None:
            return False
        generation.loop.abort([_engine_id(internal_id, i) for i in range(len(generation.choices))])
        return True

    def on_outputs(self, outputs: list[RequestOutput], step_s: float, tokens: dict[str, int]) -> None:
        """One engine step's output: stream chunks, answer finished sequences. The step's time is
        split among the sequences it computed by their tokens (`tokens`: a 500-token prompt chunk
        costs 500 decodes), also those still in prefill, which have no output yet."""
        total = sum(tokens.values())
        model = None
        num_sequences = len(tokens)
        for request_id, num_tokens in tokens.items():
            computed = self._by_id.get(_parse_engine_id(request_id)[0])
            if computed is not None:
                computed.device_s += step_s * num_tokens / total
                computed.batch_size = max(computed.batch_size, num_sequences)
                model = computed.key  # one engine's step: every sequence in it is of the same model
        if model is not None:
            self._cost(model).step(step_s, total)
        for output in outputs:
            internal_id, index = _parse_engine_id(output.request_id)
            generation = self._by_id.get(internal_id)
            if generation is None:
                continue  # withdrawn meanwhile
            self._deliver(generation, index, output)
            if output.is_finished:
                self._finish(internal_id, generation, index, output)

    def _deliver(self, generation: _Generation, index: int, output: RequestOutput) -> None:
        """A step's new text (and log-probabilities, and the echoed prompt with the first token):
        streamed as a chunk, or kept for the whole answer."""
        prompt = None
        if generation.echo_prompt_ids is not None and output.new_token_ids:
            prompt = _echoed(generation.loop.runner.tokenizer, generation.echo_prompt_ids, output.prompt_logprobs)
            generation.echo_prompt_ids = None
        token_ids, text = list(output.new_token_ids), output.text_delta
        logprobs = _logprobs(generation.loop.runner.tokenizer, output.logprobs) if output.logprobs else None
        if generation.is_prompt_only:  # scored, not generated: its one token is not reported
            token_ids, text, logprobs = [], "", None
        choice = generation.choices[index]
        choice.num_output_tokens = 0 if generation.is_prompt_only else output.num_output_tokens
        choice.num_cache_write_tokens = output.num_cache_write_tokens
        if choice.thoughts is not None:
            choice.thoughts.add(text, len(token_ids))
        if generation.is_streamed and output.new_token_ids:
            prompt_token_ids, generation.prompt_token_ids = generation.prompt_token_ids, None
            is_last = output.is_finished and output.finish_reason in ("stop", "length") and all(
                other.finish_reason is not None for i, other in enumerate(generation.choices) if i != index)
            self._reply(generation.identity, wire.TokenChunk(
                generation.gateway_request_id, text, token_ids, output.num_prompt_tokens, output.num_cached_tokens,
                generation.device_s, logprobs, prompt, index, prompt_token_ids, is_last))
        else:
            choice.parts.append(text)
            if choice.token_ids is not None:
                choice.token_ids.extend(token_ids)
            generation.prompt = prompt or generation.prompt
            if logprobs:
                if choice.logprobs is None:
                    choice.logprobs = []
                choice.logprobs.extend(logprobs)
            if not generation.is_started:
                self._reply(generation.identity, wire.Started([generation.gateway_request_id]))
        generation.is_started = True

    def _cost(self, model: tuple[str, str]) -> _RecentCost:
        cost = self._costs.get(model)
        if cost is None:
            cost = self._costs[model] = _RecentCost()
        return cost

    def _finish(self, internal_id: int, generation: _Generation, index: int, output: RequestOutput) -> None:
        """One of its sequences ended: the request is answered once all have, or at once if one
        ended otherwise than by stop or length (the others are withdrawn)."""
        generation.choices[index].finish_reason = output.finish_reason
        is_complete = output.finish_reason in ("stop", "length")
        if is_complete:
            self._cost(generation.key).finished(output.num_output_tokens, generation.max_tokens)
            if any(choice.finish_reason is None for choice in generation.choices):
                return
        else:
            unfinished = [_engine_id(internal_id, i) for i, choice in enumerate(generation.choices)
                          if choice.finish_reason is None]
            if unfinished:
                generation.loop.abort(unfinished)
        del self._by_id[internal_id]
        self._forget(generation.identity, generation.gateway_request_id)
        result = self._result(generation, output)
        if result is not None:
            self._reply(generation.identity, result)

    def _result(self, generation: _Generation, last: RequestOutput) -> wire.Result | None:
        """The answer of a generation whose `last` output ended it; None if it was aborted (the
        gateway withdrew it and expects no answer)."""
        request_id = generation.gateway_request_id
        num_output_tokens = sum(choice.num_output_tokens for choice in generation.choices)
        num_tokens = last.num_prompt_tokens + num_output_tokens  # charged whatever the outcome
        reason = last.finish_reason
        if reason == "deadline":
            return wire.Result(request_id, wire.Outcome.EXPIRED, num_tokens=num_tokens, device_s=generation.device_s,
                               message="the deadline passed before the generation finished")
        if reason in ("stop", "length"):
            first, *others = generation.choices
            is_whole = not generation.is_streamed
            payload = wire.GenerationResult(
                "".join(first.parts) if is_whole else "", first.finish_reason or reason, last.num_prompt_tokens,
                last.num_cached_tokens, num_output_tokens, first.logprobs if is_whole else None,
                generation.prompt if is_whole else None,
                [wire.GeneratedChoice("".join(c.parts) if is_whole else "", c.finish_reason or reason,
                                      c.logprobs if is_whole else None, c.token_ids if is_whole else None)
                 for c in others],
                first.token_ids if is_whole else None, generation.prompt_token_ids if is_whole else None,
                sum(c.thoughts.finish() for c in generation.choices if c.thoughts is not None),
                sum(c.num_cache_write_tokens for c in generation.choices))
            return wire.Result(request_id, wire.Outcome.OK, payload=payload, num_tokens=num_tokens,
                               device_s=generation.device_s, batch_size=generation.batch_size)
        if reason == "refused":  # the engine's early refusal: the queue ahead is too long
            if self._refused_work is not None:
                predicted_s = self._cost(generation.key).predicted_s(last.num_prompt_tokens, generation.max_tokens)
                self._refused_work(*generation.key, predicted_s * len(generation.choices))
            retry_after_s = max(last.retry_after_s, 0.001) if last.retry_after_s is not None else 1.0
            return wire.Result(request_id, wire.Outcome.REJECTED, retry_after_s=retry_after_s,
                               message="worker overloaded: queued generations would miss the deadline")
        if reason == "error":
            return _failure(request_id, num_tokens, generation.device_s)
        if reason == "unusable_format":
            return _unusable(request_id, generation.output_format, last.message or "", num_tokens,
                             generation.device_s)
        return None


def _outcome(runner: GenerativeRunner, payload: wire.TokenizePayload) -> wire.TokenizeResult | Exception:
    """The tokenizer's answer, or the exception it raised (logged unless it is the input's fault)."""
    try:
        return runner.tokenize(payload)
    except InvalidInput as exc:
        return exc
    except Exception as exc:
        log.exception("a tokenizer request failed")
        return exc


def _engine_id(internal_id: int, index: int) -> str:
    """The engine's id of choice `index` of a request: the request's id, then `/index` past the first."""
    return str(internal_id) if index == 0 else f"{internal_id}/{index}"


def _parse_engine_id(engine_id: str) -> tuple[int, int]:
    head, _, index = engine_id.partition("/")
    return int(head), int(index or 0)


def _choice_of(prepared: PreparedGeneration, index: int) -> PreparedGeneration:
    """Choice `index`'s sequence: seeded `seed + index` (wrapping within 64 bits), so n seeded
    choices differ from each other and each is reproducible. Only the first computes the prompt's
    log-probabilities (an echo is sent once); the others take its blocks from the prefix cache.
    Each has its own copy of a structured output's grammar state: make them all before the first
    is queued (the engine moves its state on as it samples)."""
    if index == 0:
        return prepared
    seed = prepared.params.seed
    low, high = wire.SEED_RANGE
    params = replace(prepared.params, prompt_logprobs=None,
                     seed=None if seed is None else (seed + index - low) % (high - low + 1) + low)
    return replace(prepared, params=params, matcher=None if prepared.matcher is None else prepared.matcher.deep_copy())


def _logprobs(tokenizer: Tokenizer, reported: tuple[TokenLogprobs, ...]) -> list[wire.TokenLogprob]:
    """The engine's log-probabilities with each token's text, as they go on the wire."""
    text, raw = tokenizer.token_text, tokenizer.token_bytes
    return [wire.TokenLogprob(text(lp.token_id), lp.token_id, lp.logprob,
                              [wire.TopLogprob(text(token_id), token_id, value, raw(token_id))
                               for token_id, value in lp.top], raw(lp.token_id))
            for lp in reported]


def _echoed(tokenizer: Tokenizer, prompt_ids: list[int],
            reported: tuple[TokenLogprobs, ...] | None) -> wire.EchoedPrompt:
    """The prompt as the model read it, and its tokens' log-probabilities if they were computed."""
    text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
    return wire.EchoedPrompt(text, tokenizer.token_text(prompt_ids[0]),
                             None if reported is None else _logprobs(tokenizer, reported),
                             tokenizer.token_bytes(prompt_ids[0]))


def _unusable(request_id: int, output_format: wire.OutputFormat | None, why: str, num_tokens: int,
              device_s: float) -> wire.Result:
    """The answer to a generation whose structured output proved too complex to follow as it
    ran: the request's fault (400 naming the field, as a format that does not compile is), not a
    transient failure that a retry could cure."""
    kind, param = ("structured output", None) if output_format is None else \
        (output_format.kind.replace("_", " "), output_format.param)
    message = f"unusable {kind}: {why}; ask for a simpler one"
    return wire.Result(request_id, wire.Outcome.FAILED, num_tokens=num_tokens, device_s=device_s, message=message,
                       errors=[wire.ItemError(-1, message, param=param)])


def _failure(request_id: int, num_tokens: int, device_s: float) -> wire.Result:
    """The answer to a generation the model failed: a transient error, which the gateway answers
    with 503 (retryable), not as the input's fault."""
    message = "the model failed while generating; try again"
    return wire.Result(request_id, wire.Outcome.FAILED, num_tokens=num_tokens, device_s=device_s, message=message,
                       errors=[wire.ItemError(-1, message, is_transient=True)])

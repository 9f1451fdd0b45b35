"""A generative model's engine, stepped on its own thread while it has sequences.

    loop thread                               generation thread
    ───────────                               ─────────────────
    submit() ─▶ engine.add_request ──(inbox)──▶ step() ─▶ step() ─▶ ... (until nothing is left)
    abort()  ─▶ engine.abort ───────(inbox)──▶   freed within one step
    on_outputs(outputs, step_s) ◀── call_soon_threadsafe, once per step that produced output
                                              (a step that raises ends every sequence with "error")

The engine does continuous batching itself: a request joins the running batch at the next step
and leaves it the step it finishes, so this thread only has to keep stepping. `Generations` is the
loop thread's side: where each request's output goes (chunks, `Started`, the final `Result`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sluice import wire
from sluice.clock import Clock
from sluice.engines.generative.engine import RequestOutput
from sluice.engines.generative.runner import GenerativeRunner, PreparedGeneration
from sluice.errors import InvalidInput
from sluice.priority import Priority

log = logging.getLogger("sluice.worker")

OnOutputs = Callable[[list[RequestOutput], float], None]


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
               salt: str) -> None:
        """Queue a sequence; `InvalidInput` for one the engine cannot serve (too long, bad ids)."""
        try:
            self._engine.add_request(request_id, prepared.prompt_token_ids, prepared.params, priority=priority,
                                     deadline=deadline, salt=salt)
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
                try:
                    outputs = self._engine.step()
                except Exception:  # an engine bug or a device fault: keep the worker alive
                    log.exception("generation step failed; ending this model's sequences with an error")
                    outputs = self._engine.fail_all()
                if outputs:
                    self._loop.call_soon_threadsafe(self._on_outputs, outputs, time.perf_counter() - started)


@dataclass(slots=True)
class _Generation:
    """A generation in the engine: where its output goes."""

    identity: bytes
    gateway_request_id: int
    loop: GenerationLoop
    is_streamed: bool
    parts: list[str] = field(default_factory=list)
    device_s: float = 0.0
    is_started: bool = False


class Generations:
    """The worker's generation requests, by internal id: submitted to their model's loop, streamed
    back as `TokenChunk`s (or collected, unstreamed), answered with one `Result` when they end.
    `forget(identity, gateway_request_id)` is called when one has been answered."""

    def __init__(self, clock: Clock, reply: wire.Reply, forget: Callable[[bytes, int], None]) -> None:
        self._clock = clock
        self._reply = reply
        self._forget = forget
        self._by_id: dict[int, _Generation] = {}

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def submit(self, internal_id: int, identity: bytes, message: wire.Submit, loop: GenerationLoop) -> bool:
        """Queue it on `loop`; False (and the request answered with its error) if it cannot run."""
        payload = message.payload
        try:
            if not isinstance(payload, wire.GeneratePayload):
                raise InvalidInput(f"model {message.model} generates text: use /v1/completions or /v1/chat/completions")
            prepared = loop.runner.prepare(payload)
            loop.submit(str(internal_id), prepared, Priority(message.priority),
                        self._clock.now() + message.timeout_s, salt=message.tenant)
        except InvalidInput as exc:
            self._reply(identity, wire.Result(message.request_id, wire.Outcome.FAILED,
                                              errors=[wire.ItemError(-1, exc.message)], message=exc.message))
            return False
        self._by_id[internal_id] = _Generation(identity, message.request_id, loop, payload.stream)
        return True

    def cancel(self, internal_id: int) -> bool:
        """Withdraw it (its blocks are freed within one step); False if it is not a generation."""
        generation = self._by_id.pop(internal_id, None)
        if generation is None:
            return False
        generation.loop.abort([str(internal_id)])
        return True

    def on_outputs(self, outputs: list[RequestOutput], step_s: float) -> None:
        """One engine step's output: stream chunks, answer finished sequences; the step's time is
        split evenly among the sequences it advanced."""
        share_s = step_s / len(outputs)
        for output in outputs:
            internal_id = int(output.request_id)
            generation = self._by_id.get(internal_id)
            if generation is None:
                continue  # withdrawn meanwhile
            generation.device_s += share_s
            if generation.is_streamed and output.new_token_ids:
                self._reply(generation.identity, wire.TokenChunk(
                    generation.gateway_request_id, output.text_delta, list(output.new_token_ids),
                    output.num_prompt_tokens, output.num_cached_tokens, generation.device_s))
            else:
                generation.parts.append(output.text_delta)
                if not generation.is_started:
                    self._reply(generation.identity, wire.Started([generation.gateway_request_id]))
            generation.is_started = True
            if output.is_finished:
                self._finish(internal_id, generation, output)

    def _finish(self, internal_id: int, generation: _Generation, output: RequestOutput) -> None:
        del self._by_id[internal_id]
        self._forget(generation.identity, generation.gateway_request_id)
        request_id = generation.gateway_request_id
        num_tokens = output.num_prompt_tokens + output.num_output_tokens  # charged whatever the outcome
        if output.finish_reason == "deadline":
            result = wire.Result(request_id, wire.Outcome.EXPIRED, num_tokens=num_tokens, device_s=generation.device_s,
                                 message="the deadline passed before the generation finished")
        elif output.finish_reason in ("stop", "length"):
            text = "" if generation.is_streamed else "".join(generation.parts)
            payload = wire.GenerationResult(text, output.finish_reason, output.num_prompt_tokens,
                                            output.num_cached_tokens, output.num_output_tokens)
            result = wire.Result(request_id, wire.Outcome.OK, payload=payload, num_tokens=num_tokens,
                                 device_s=generation.device_s)
        elif output.finish_reason == "refused":  # the engine's early refusal: the queue ahead is too long
            result = wire.Result(request_id, wire.Outcome.REJECTED, retry_after_s=1.0,
                                 message="worker overloaded: queued generations would miss the deadline")
        elif output.finish_reason == "error":
            message = "the model failed while generating; try again"
            result = wire.Result(request_id, wire.Outcome.FAILED, num_tokens=num_tokens, device_s=generation.device_s,
                                 message=message, errors=[wire.ItemError(-1, message, is_transient=True)])
        else:
            return  # aborted: the gateway withdrew it and expects no answer
        self._reply(generation.identity, result)

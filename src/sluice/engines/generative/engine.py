"""`LLMEngine`: the iteration-level loop that ties scheduler, model runner and sampler together.

    step():  inbox -> Scheduler.schedule -> ModelRunner.prepare/execute -> Sampler.sample
                   -> Scheduler.update -> stop checks + detokenization -> [RequestOutput]

`step()` runs on one thread (the worker's device thread). `add_request` and `abort` may be called
from any thread: they validate at once (raising `ValueError` for bad input) and leave a message in
a locked inbox that the next `step()` drains, so an abort frees its blocks within one step.

One request cannot end the others: a sequence whose sampling or output handling fails ends alone
with finish_reason "error"; a failed forward pass ends the sequences of that step. Only a failure
in the scheduler itself leaves `step()` raising, and then `fail_all` ends every sequence.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from llguidance import LLMatcher

from sluice.clock import Clock, MonotonicClock
from sluice.engines.generative.block_manager import BlockManager
from sluice.engines.generative.config import EngineConfig
from sluice.engines.generative.model import KVCache, read_spec
from sluice.engines.generative.model_runner import DTYPES, ModelRunner, StepInput
from sluice.engines.generative.sampler import Sampled, Sampler, SampleRow
from sluice.engines.generative.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from sluice.engines.generative.sequence import FinishReason, SamplingParams, Sequence, TokenLogprobs
from sluice.engines.generative.static_scheduler import StaticScheduler
from sluice.engines.generative.structured import Grammars, masks
from sluice.engines.generative.tokenizer import Detokenizer, StopChecker, Tokenizer
from sluice.priority import Priority

__all__ = ["EngineStats", "LLMEngine", "RequestOutput", "StepTiming"]

log = logging.getLogger("sluice.engine")


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    is_finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "deadline" | "refused" | "error" | "unusable_format"
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    retry_after_s: float | None = None  # "refused": when the same request would be taken
    logprobs: tuple[TokenLogprobs, ...] = ()
    """One per new token, if the request asked for log-probabilities."""
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    """With the first new token, if the request asked for them: one per prompt token but the first."""
    message: str | None = None
    """"unusable_format": what its grammar's matcher gave up on."""
    num_cache_write_tokens: int = 0
    """Prompt tokens it wrote to the prefix cache (`Sequence.num_cache_write_tokens`)."""


class UnusableFormat(ValueError):
    """A sequence's grammar matcher gave up (its lexer or parser limits): the format's fault."""


@dataclass(frozen=True, slots=True)
class StepTiming:
    """Host wall time of a step's phases. On CUDA the forward pass is queued, not waited for
    (all the more a replayed graph's), so `sample_s`, which reads the sampled tokens back,
    holds most of the device's time."""

    schedule_s: float
    prepare_s: float
    forward_s: float
    sample_s: float
    output_s: float
    num_seqs: int
    num_batched_tokens: int

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.forward_s + self.sample_s + self.output_s


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    last_step: StepTiming | None


@dataclass(slots=True)
class _Request:
    seq: Sequence
    detokenizer: Detokenizer | None
    stops: StopChecker
    prompt_logprobs: list[TokenLogprobs] | None = None
    """Prompt positions 1, 2, ... computed so far, if asked for (a recomputed prefix is not added twice)."""
    prefix_of: str | None = None
    """The request whose prompt this one shares (`add_request(prefix_of=...)`)."""
    matcher: LLMatcher | None = None
    """Its structured output's grammar state (`add_request(matcher=...)`): what it may sample next."""


class LLMEngine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, *,
                 clock: Clock | None = None) -> None:
        self.config = config = config or EngineConfig()
        model_dir = Path(model_dir)
        self.spec = read_spec(model_dir)
        self.tokenizer = Tokenizer(model_dir) if (model_dir / "tokenizer.json").exists() else None
        self.eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer else ()
        self.grammars = None if self.tokenizer is None else \
            Grammars(self.tokenizer.to_json(), self.spec.vocab_size, self.eos_token_ids)
        """Compiles structured outputs' grammars for `add_request(matcher=...)`; None without a tokenizer."""
        bytes_per_block = KVCache.bytes_per_block(self.spec, config.block_size, DTYPES[config.dtype])
        measured = config.gpu_memory_utilization is not None and config.num_kv_blocks is None
        self._runner = ModelRunner(model_dir, self.spec, num_blocks=None if measured else
                                   config.num_blocks_for(bytes_per_block), block_size=config.block_size,
                                   dtype=config.dtype, device=config.device)
        if measured:
            assert config.gpu_memory_utilization is not None
            self._runner.allocate_cache(self._runner.blocks_for_memory(
                config.gpu_memory_utilization, config.max_num_batched_tokens, bytes_per_block))
        self.num_blocks = self._runner.cache.num_blocks
        self._max_model_len = min(self.spec.max_model_len, config.max_model_len or self.spec.max_model_len)
        if config.cuda_graphs and config.device.startswith("cuda"):
            self._runner.use_decode_graphs(config.max_num_seqs, self._max_model_len)
        self._blocks = BlockManager(self.num_blocks, config.block_size)
        self._scheduler = self._make_scheduler(config)
        self._sampler = Sampler(config.device)
        self._clock = clock or MonotonicClock()
        self._lock = threading.Lock()
        self._inbox: list[_Request | str] = []  # a new request, or the id of one to abort
        self._known_ids: set[str] = set()
        self._requests: dict[str, _Request] = {}
        self._last_step: StepTiming | None = None
        self.last_step_tokens: dict[str, int] = {}
        """Tokens the last step computed for each sequence (prompt chunks and decodes), by request id."""

    def _make_scheduler(self, config: EngineConfig) -> Scheduler:
        scheduler_config = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                           config.long_prefill_token_threshold)
        if config.scheduling == "continuous":
            return Scheduler(scheduler_config, self._blocks)
        reserve_max_model_len = config.static_reserve == "max_model_len"
        if reserve_max_model_len and self._max_model_len > self.num_blocks * config.block_size:
            raise ValueError(f"static batching reserves max_model_len = {self._max_model_len} tokens per sequence; "
                             f"the KV cache holds {self.num_blocks * config.block_size}")
        return StaticScheduler(scheduler_config, self._blocks, self._max_model_len, reserve_max_model_len)

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        """Token ids the model knows are [0, vocab_size) (its logits' width)."""
        return self.spec.vocab_size

    # ---- any thread ----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, *,
                    priority: Priority = Priority.STANDARD, deadline: float | None = None, salt: str = "",
                    prefix_of: str | None = None, matcher: LLMatcher | None = None, cache_salt: str = "") -> None:
        """Queue a request. Raises ValueError for input the engine cannot serve (-> 400).
        `salt`: its tenant's name; `cache_salt`: its own salt (vLLM's), added to the tenant's for
        the prefix cache. `prefix_of`: a request added before with the same prompt and salts (another choice of the
        same client request); this one is admitted once that one has computed the prompt, and
        shares its full blocks through the prefix cache instead of computing them again.
        `matcher`: a fresh grammar matcher (`grammars.matcher(...)`, one per request): it samples
        only tokens the grammar allows, and finishes once the grammar is complete."""
        prompt = list(prompt_token_ids)
        self._validate(prompt, params)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer.json in the model folder")
        if matcher is not None and params.min_tokens:
            raise ValueError("min_tokens cannot be combined with a structured output (its grammar decides the end)")
        seq = Sequence(request_id, prompt, params, self._clock.now(), priority, deadline, salt, cache_salt)
        detok = Detokenizer(self.tokenizer, prompt, params.skip_special_tokens) if self.tokenizer else None
        with self._lock:
            if request_id in self._known_ids:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._known_ids.add(request_id)
            self._inbox.append(_Request(seq, detok, StopChecker(params.stop, params.include_stop_str_in_output),
                                        None if params.prompt_logprobs is None else [], prefix_of, matcher))

    def abort(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            self._inbox.extend(request_ids)

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        """Tenants' fair-share weights for the scheduler (see `scheduler.py`); ValueError if one is
        not a positive number."""
        self._scheduler.set_tenant_weights(weights)

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        vocab_size = self.vocab_size
        if not prompt:
            raise ValueError("the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        if any(not 0 <= t < vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size})")
        if any(not 0 <= t < vocab_size for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt)} tokens; this model's context is {self.max_model_len}")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(context_length_message(self.max_model_len, len(prompt), params.max_tokens))
        capacity = self.num_blocks * self.config.block_size
        if len(prompt) + params.max_tokens > capacity:
            raise ValueError(f"prompt + max_tokens = {len(prompt) + params.max_tokens} tokens exceeds the KV cache "
                             f"({capacity} tokens)")

    # ---- the device thread -----------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        with self._lock:
            if self._inbox:
                return True
        return self._scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        prefix = self._blocks.stats()
        return EngineStats(len(self._scheduler.running), len(self._scheduler.waiting), self._blocks.usage,
                           self._scheduler.num_preemptions_total, prefix.num_query_tokens, prefix.num_hit_tokens,
                           self._last_step)

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self.last_step_tokens = {}  # a step that fails before it is scheduled computed nothing
        self._drain_inbox()
        scheduled = self._scheduler.schedule(self._clock.now())
        self.last_step_tokens = {chunk.request_id: len(chunk.token_ids) for chunk in scheduled.chunks}
        t1 = time.perf_counter()
        outputs = [self._finished_output(seq) for seq in scheduled.finished if seq.request_id in self._requests]
        draws: dict[str, Sampled] = {}
        t2 = t3 = t1
        if scheduled.chunks:
            try:
                inp = self._runner.prepare(scheduled, self._prompt_lengths(scheduled))
                t2 = time.perf_counter()
                logits = self._runner.run(inp)
                t3 = time.perf_counter()
            except Exception:  # the device or the model: this step's sequences cannot go on
                log.exception("a model step of %d sequences failed; ending them", len(scheduled.chunks))
                return outputs + self._fail([chunk.request_id for chunk in scheduled.chunks])
            failed = self._record_prompt_logprobs(inp, logits) if inp.prompt_spans else []
            draws, unsampled = self._sample(scheduled, logits[:inp.num_sample_rows])
            if unsampled:
                log.error("requests %s could not be sampled (see above); ending them", ", ".join(unsampled))
            for request_id in failed:
                draws.pop(request_id, None)
            outputs += self._fail(unsampled + failed)
        t4 = time.perf_counter()
        sampled = {request_id: draw.token_id for request_id, draw in draws.items()}
        outputs += self._process(self._scheduler.update(scheduled, sampled), draws)
        t5 = time.perf_counter()
        self._last_step = StepTiming(t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, len(scheduled.chunks),
                                     scheduled.num_batched_tokens)
        return outputs

    def fail_all(self) -> list[RequestOutput]:
        """After a step raised: end every sequence, queued or running, with finish_reason "error",
        freeing its blocks, so that its client hears at once instead of at its deadline. The
        engine stays usable for new requests."""
        self._drain_inbox()
        outputs = []
        for request_id in list(self._requests):
            seq = self._requests[request_id].seq
            self._scheduler.finish(seq, FinishReason.ERROR)
            self._forget(request_id)
            outputs.append(self._output(seq, (), ""))
        self._scheduler.discard_finished()
        return outputs

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for item in inbox:
            if isinstance(item, _Request):
                parent = self._requests.get(item.prefix_of) if item.prefix_of is not None else None
                if (parent is not None and parent.seq.prefix_salt == item.seq.prefix_salt
                        and parent.seq.prompt_token_ids == item.seq.prompt_token_ids):
                    item.seq.prefix_parent = parent.seq
                self._requests[item.seq.request_id] = item
                self._scheduler.add(item.seq)
            elif item in self._requests:
                self._scheduler.abort(item)

    def _prompt_lengths(self, scheduled: SchedulerOutput) -> dict[str, int]:
        """The prompt lengths of this step's sequences whose prompt logits are still wanted."""
        wanted = {}
        for chunk in scheduled.chunks:
            req = self._requests[chunk.request_id]
            if req.prompt_logprobs is not None and len(req.prompt_logprobs) < req.seq.num_prompt_tokens - 1:
                wanted[chunk.request_id] = req.seq.num_prompt_tokens
        return wanted

    def _record_prompt_logprobs(self, inp: StepInput, logits: torch.Tensor) -> list[str]:
        """Keep the prompt log-probabilities this step computed (after the sampling rows, span by
        span); the ids of the sequences whose could not be computed (they end alone, with an
        error, once the step's rows have been sampled)."""
        failed = []
        row = inp.num_sample_rows
        for span in inp.prompt_spans:
            rows = logits[row:row + span.count]
            row += span.count
            req = self._requests[span.request_id]
            known = req.prompt_logprobs
            assert known is not None and span.first_position <= len(known), "prompt chunks run in order"
            skip = len(known) - span.first_position  # recomputed after a preemption: already kept
            if skip >= span.count:
                continue
            first = span.first_position + skip
            targets = req.seq.prompt_token_ids[first + 1:span.first_position + span.count + 1]
            try:
                known.extend(self._sampler.prompt_logprobs(rows[skip:], targets, req.seq.params.prompt_logprobs or 0))
            except Exception:
                log.exception("request %s: its prompt log-probabilities failed; ending it", span.request_id)
                failed.append(span.request_id)
        return failed

    def _sample(self, scheduled: SchedulerOutput, logits: object) -> tuple[dict[str, Sampled], list[str]]:
        """What was sampled for each sequence that needs a token (the token, and its
        log-probabilities if asked for), and the ids of those that could not be sampled."""
        rows: list[SampleRow] = []
        constrained: list[tuple[int, LLMatcher]] = []
        for chunk in scheduled.chunks:
            if chunk.needs_sample:
                req = self._requests[chunk.request_id]
                params = req.seq.params
                blocked = () if params.min_tokens == 0 else (*self.eos_token_ids, *params.stop_token_ids)
                if req.matcher is not None:
                    constrained.append((len(rows), req.matcher))
                rows.append(SampleRow(chunk.request_id, req.seq.params, req.seq.all_token_ids,
                                      req.seq.num_output_tokens, blocked))
        if constrained:
            allowed = masks([matcher for _, matcher in constrained], self.vocab_size)
            for (i, _), row_allowed in zip(constrained, allowed, strict=True):
                rows[i] = replace(rows[i], allowed=row_allowed)
        draws = self._sampler.sample(logits, rows)  # type: ignore[arg-type]
        sampled = {row.request_id: draw for row, draw in zip(rows, draws, strict=True) if draw is not None}
        return sampled, [row.request_id for row, draw in zip(rows, draws, strict=True) if draw is None]

    def _fail(self, request_ids: list[str]) -> list[RequestOutput]:
        """End these sequences with finish_reason "error" (their blocks are freed now)."""
        outputs = []
        for request_id in request_ids:
            req = self._requests.get(request_id)
            if req is None:
                continue
            self._scheduler.finish(req.seq, FinishReason.ERROR)
            self._forget(request_id)
            outputs.append(self._output(req.seq, (), ""))
        return outputs

    def _process(self, advanced: list[Sequence], draws: Mapping[str, Sampled]) -> list[RequestOutput]:
        outputs = []
        for seq in advanced:
            try:
                outputs.append(self._advance(seq, draws[seq.request_id].logprobs))
            except UnusableFormat as exc:
                outputs.append(self._end_unusable(seq, str(exc)))
            except Exception:
                log.exception("request %s: handling its new token failed; ending it", seq.request_id)
                outputs += self._fail([seq.request_id])
        return outputs

    def _advance(self, seq: Sequence, logprobs: TokenLogprobs | None) -> RequestOutput:
        """Stop checks and detokenization for a sequence that got a token (with its
        log-probabilities, if asked for)."""
        req = self._requests[seq.request_id]
        token = seq.output_token_ids[-1]
        params = seq.params
        reason = None
        text = ""
        can_stop = seq.num_output_tokens > params.min_tokens
        is_eos = token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)
        matcher = req.matcher
        if matcher is not None and not matcher.consume_token(token):
            if matcher.is_error():  # its limits reached, not a token the mask should have kept out
                raise UnusableFormat(matcher.get_error().split("\n", 1)[0])
            raise RuntimeError(f"its grammar refused the sampled token {token}: {matcher.get_error()}")
        is_stop_string = False
        if is_eos and seq.num_output_tokens >= params.min_tokens:
            reason = FinishReason.STOP
        elif req.detokenizer is not None:
            text, is_stop_string = req.stops.push(req.detokenizer.push([token]), can_stop)
            reason = FinishReason.STOP if is_stop_string else None
        if reason is None and matcher is not None and matcher.is_stopped():
            reason = FinishReason.STOP  # the grammar is complete: nothing but its end may follow
        if reason is None and seq.num_output_tokens >= params.max_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            self._scheduler.finish(seq, reason)
            if req.detokenizer is not None and not is_stop_string:  # a character cut short: U+FFFD
                text += req.stops.push(req.detokenizer.flush(), can_stop)[0]
            text += req.stops.flush()
            self._forget(seq.request_id)
        output = self._output(seq, (token,), text, () if logprobs is None else (logprobs,))
        if seq.num_output_tokens == 1 and req.prompt_logprobs is not None:
            output = replace(output, prompt_logprobs=tuple(req.prompt_logprobs))
        return output

    def _end_unusable(self, seq: Sequence, message: str) -> RequestOutput:
        """End a sequence whose grammar its matcher gave up on (`FinishReason.UNUSABLE_FORMAT`)."""
        self._scheduler.finish(seq, FinishReason.UNUSABLE_FORMAT)
        self._forget(seq.request_id)
        return replace(self._output(seq, (), ""), message=message)

    def _finished_output(self, seq: Sequence) -> RequestOutput:
        text = self._requests[seq.request_id].stops.flush()
        self._forget(seq.request_id)
        return self._output(seq, (), text)

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._sampler.forget(request_id)
        with self._lock:
            self._known_ids.discard(request_id)

    @staticmethod
    def _output(seq: Sequence, new_token_ids: tuple[int, ...], text: str,
                logprobs: tuple[TokenLogprobs, ...] = ()) -> RequestOutput:
        reason = seq.finish_reason.value if seq.finish_reason else None
        return RequestOutput(seq.request_id, new_token_ids, text, seq.is_finished, reason, seq.num_prompt_tokens,
                             seq.num_cached_tokens, seq.num_output_tokens, seq.retry_after_s, logprobs,
                             num_cache_write_tokens=seq.num_cache_write_tokens)


def context_length_message(max_model_len: int, num_prompt_tokens: int, max_tokens: int) -> str:
    """The refusal of a request whose prompt and output cannot fit the context (vLLM's wording)."""
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} in the "
            f"completion). Please reduce the length of the prompt or max_tokens.")

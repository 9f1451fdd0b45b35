"""What one generation request is, inside the engine: its parameters and its mutable state.

Pure: no torch. `SamplingParams` is a frozen value validated with `ValueError` (the integrator
maps it to 400). `Sequence` is owned by the scheduler; the engine's output step appends tokens
through `Sequence.append` and nothing else mutates it.

    all_token_ids = prompt_token_ids + output_token_ids
                    |<--- num_computed_tokens --->|<- still to compute ->|
    (KV for the computed prefix lives in the blocks the block manager holds for `request_id`)
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from sluice.priority import Priority
from sluice.wire import MAX_LOGPROBS, SEED_RANGE

__all__ = ["GREEDY_BELOW_TEMPERATURE", "MAX_LOGPROBS", "SEED_RANGE", "FinishReason", "SamplingParams", "Sequence",
           "SequenceStatus", "TokenLogprobs"]

GREEDY_BELOW_TEMPERATURE = 1e-5
"""A temperature below this is greedy: dividing logits by it overflows to inf (vLLM does the same)."""


class SequenceStatus(enum.StrEnum):
    WAITING = "waiting"
    """Queued, holds no KV blocks yet."""
    RUNNING = "running"
    """Holds KV blocks; scheduled every step until it finishes or is preempted."""
    PREEMPTED = "preempted"
    """Its blocks were taken back; waits again and recomputes its KV when readmitted."""
    FINISHED = "finished"
    """Done; its blocks are freed and it is reported once more, then forgotten."""


class FinishReason(enum.StrEnum):
    STOP = "stop"
    """EOS, a stop token id or a stop string."""
    LENGTH = "length"
    """`max_tokens` reached, or the model's context length."""
    ABORT = "abort"
    """Cancelled by the client (`LLMEngine.abort`)."""
    DEADLINE = "deadline"
    """The request's deadline passed before it finished (the integrator answers 504)."""
    REFUSED = "refused"
    """Not queued: the sequences ahead of it would keep it waiting past its deadline (see the
    scheduler's early refusal; the integrator answers 503 with Retry-After)."""
    ERROR = "error"
    """A step failed inside the engine (`LLMEngine.fail_all`): the device, not the request (503)."""
    UNUSABLE_FORMAT = "unusable_format"
    """Its structured output's grammar proved too complex to follow while generating (the
    matcher's limits, `a{1000000}` say, are only reached as it runs): the request's fault, so the
    integrator answers 400 naming the field (`RequestOutput.message` says why)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    """0 (or anything below `GREEDY_BELOW_TEMPERATURE`) means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1) disables top-k."""
    min_p: float = 0.0
    """Drop tokens less likely than this fraction of the most likely one (0: off)."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated (OpenAI's semantics)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was already generated."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before sampling."""
    logprobs: int | None = None
    """None: none reported. k >= 0: each output token's log-probability and the k most likely
    alternatives', from the model's own distribution (before penalties, biases and temperature)."""
    prompt_logprobs: int | None = None
    """None: none. k >= 0: each prompt token's (but the first's) log-probability and its k most
    likely alternatives'. Such a sequence computes its whole prompt: no prefix-cache hits."""
    skip_special_tokens: bool = True
    """Leave special tokens (`<|eot_id|>`, `[TOOL_CALLS]`, ...) out of the text, as vLLM does by default."""
    include_stop_str_in_output: bool = False
    """End the text with the stop string that ended it, rather than before it."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be between 0 and max_tokens")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1, 0 (disabled) or >= 1")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError("repetition_penalty must be > 0")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be >= 0")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError("seed must be a signed 64-bit integer")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2]")
        if any(t < 0 or not (math.isfinite(b) and -100.0 <= b <= 100.0) for t, b in self.logit_bias):
            raise ValueError("logit_bias maps token ids >= 0 to biases in [-100, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One output token's log-probability under the model, and the most likely tokens' there."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token id, log-probability), most likely first; as many as `SamplingParams.logprobs`."""


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float
    priority: Priority = Priority.STANDARD
    deadline_s: float | None = None
    salt: str = ""
    cache_salt: str = ""
    """The request's own salt (vLLM's `cache_salt`), added to the tenant's for the prefix cache."""
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at first admission (usage.cached_tokens)."""
    num_cache_write_tokens: int = 0
    """Prompt tokens whose full blocks it computed and wrote to the prefix cache before any
    preemption (usage.cache_write_tokens); not those an equal block was cached for meanwhile."""
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    retry_after_s: float | None = None
    """Refused: how long until the same request would be taken, if nothing else arrived."""
    prefix_parent: Sequence | None = None
    """A sequence with the same prompt (another choice of the same request): this one waits to be
    admitted until that one has computed its prompt, then takes the prompt's full blocks from the
    prefix cache instead of computing them again."""
    _all: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._all = list(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self._all

    @property
    def num_tokens(self) -> int:
        return len(self._all)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def tenant(self) -> str:
        """Whose sequence it is: the salt is the tenant's name (the worker passes it), which keeps
        tenants' prefix caches apart and is the flow the scheduler shares the device between."""
        return self.salt

    @property
    def prefix_salt(self) -> str:
        """What the prefix cache's hash chain starts from: the tenant's salt, and the request's
        own after a NUL if it gave one (a tenant's name has none, so no pair makes another's)."""
        return f"{self.salt}\0{self.cache_salt}" if self.cache_salt else self.salt

    @property
    def may_use_prefix_cache(self) -> bool:
        """False while the prompt's own logits are wanted (prompt log-probabilities): cached blocks
        would skip computing them. Once a token is generated they have all been reported."""
        return self.params.prompt_logprobs is None or self.num_output_tokens > 0

    @property
    def is_waiting_for_prefix(self) -> bool:
        parent = self.prefix_parent
        return parent is not None and not parent.is_finished and parent.num_output_tokens == 0

    @property
    def is_prefilling(self) -> bool:
        """More than the one newest token is still to compute."""
        return self.num_tokens - self.num_computed_tokens > 1

    def queue_key(self) -> tuple[int, float, float]:
        """Waiting order: class first, then earliest deadline, then arrival."""
        deadline = math.inf if self.deadline_s is None else self.deadline_s
        return (int(self.priority), deadline, self.arrival_s)

    def victim_key(self) -> tuple[int, float]:
        """Preemption order: the largest key goes first (lowest class, latest arrival)."""
        return (int(self.priority), self.arrival_s)

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all.append(token_id)

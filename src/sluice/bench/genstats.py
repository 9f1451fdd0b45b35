"""Pure summaries of a generative (streaming) load run, with `vllm bench serve`'s definitions.

Per request, from the client's clock (`sent` = when the request went out):

    TTFT  = first chunk carrying `choices` - sent
    ITL   = gaps between successive such chunks (one list per request; all requests' gaps pooled)
    E2E   = last chunk - sent
    TPOT  = (E2E - TTFT) / (output tokens - 1), for requests with more than one output token

Output tokens are `usage.completion_tokens` of the final chunk (`stream_options.include_usage`);
a stream without usage falls back to its number of content chunks. Over a run:

    duration              = from the first send to the last answer (of the counted requests)
    request throughput    = completed / duration
    output throughput     = Σ output tokens / duration
    total token throughput= Σ (prompt + output tokens) / duration
    goodput               = completed requests with TTFT ≤ SLO and TPOT ≤ SLO (each SLO if given) / duration

Percentiles are mean / median / p99 over requests (ITL: over all gaps), in milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["GenRateResult", "GenSample", "Percentiles", "SloConfig", "percentiles", "summarize_generation"]


@dataclass(frozen=True, slots=True)
class GenSample:
    """What happened to one streamed request. Times are seconds on the client's clock.

    `status` is the HTTP status (0: no answer); `error` is set when the stream carried an error
    event or broke off; `chunk_s` holds the arrival time of each chunk with `choices`.
    """

    scheduled_s: float
    sent_s: float
    status: int
    chunk_s: tuple[float, ...]
    done_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    requested_prompt_len: int
    requested_output_len: int
    error: str | None = None

    @property
    def is_ok(self) -> bool:
        return self.status == 200 and self.error is None and len(self.chunk_s) > 0

    @property
    def ttft_s(self) -> float:
        return self.chunk_s[0] - self.sent_s if self.chunk_s else math.nan

    @property
    def e2e_s(self) -> float:
        return self.chunk_s[-1] - self.sent_s if self.chunk_s else math.nan

    @property
    def tpot_s(self) -> float:
        if self.num_output_tokens <= 1 or not self.chunk_s:
            return math.nan
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)

    def itl_s(self) -> np.ndarray:
        return np.diff(np.asarray(self.chunk_s, dtype=np.float64))


@dataclass(frozen=True, slots=True)
class Percentiles:
    mean_ms: float
    median_ms: float
    p99_ms: float


@dataclass(frozen=True, slots=True)
class SloConfig:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None


@dataclass(frozen=True, slots=True)
class GenRateResult:
    offered_rate_per_s: float
    num_scheduled: int
    num_completed: int
    num_failed: int
    duration_s: float
    total_prompt_tokens: int
    total_output_tokens: int
    request_throughput_per_s: float
    output_throughput_tok_s: float
    total_token_throughput_tok_s: float
    ttft: Percentiles | None
    tpot: Percentiles | None
    itl: Percentiles | None
    e2e: Percentiles | None
    num_good: int | None
    goodput_per_s: float | None
    mean_prompt_len: float
    """Prompt tokens per completed request as the server counted them (`usage.prompt_tokens`)."""
    mean_requested_prompt_len: float
    mean_output_len: float
    send_lag_p99_ms: float
    first_error: str | None = None


def percentiles(seconds: np.ndarray) -> Percentiles | None:
    """mean / median / p99 in milliseconds of the finite values; `None` when there are none."""
    values = np.asarray(seconds, dtype=np.float64)
    values = values[np.isfinite(values)] * 1000.0
    if values.size == 0:
        return None
    median, p99 = np.percentile(values, [50, 99])
    return Percentiles(float(values.mean()), float(median), float(p99))


def is_good(sample: GenSample, slo: SloConfig) -> bool:
    """Whether a completed request met every SLO that is set (vLLM's goodput criterion)."""
    if not sample.is_ok:
        return False
    if slo.ttft_ms is not None and not sample.ttft_s * 1000.0 <= slo.ttft_ms:
        return False
    tpot_s = sample.tpot_s
    return slo.tpot_ms is None or math.isnan(tpot_s) or tpot_s * 1000.0 <= slo.tpot_ms


def summarize_generation(samples: Sequence[GenSample], rate_per_s: float, slo: SloConfig) -> GenRateResult:
    ok = [s for s in samples if s.is_ok]
    failed = [s for s in samples if not s.is_ok]
    sent = [s.sent_s for s in samples if math.isfinite(s.sent_s)]
    ends = [s.done_s for s in ok if math.isfinite(s.done_s)]
    duration_s = max(ends) - min(sent) if ends and sent else 0.0
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    num_prompt = sum(s.num_prompt_tokens for s in ok)
    num_output = sum(s.num_output_tokens for s in ok)
    itls = np.concatenate([s.itl_s() for s in ok]) if ok else np.empty(0)
    num_good = sum(is_good(s, slo) for s in ok) if slo.is_set else None
    lags = np.asarray([s.sent_s - s.scheduled_s for s in samples], dtype=np.float64)
    lag = percentiles(lags)
    return GenRateResult(
        offered_rate_per_s=rate_per_s,
        num_scheduled=len(samples),
        num_completed=len(ok),
        num_failed=len(failed),
        duration_s=duration_s,
        total_prompt_tokens=num_prompt,
        total_output_tokens=num_output,
        request_throughput_per_s=len(ok) * per_s,
        output_throughput_tok_s=num_output * per_s,
        total_token_throughput_tok_s=(num_prompt + num_output) * per_s,
        ttft=percentiles(np.asarray([s.ttft_s for s in ok])),
        tpot=percentiles(np.asarray([s.tpot_s for s in ok])),
        itl=percentiles(itls),
        e2e=percentiles(np.asarray([s.e2e_s for s in ok])),
        num_good=num_good,
        goodput_per_s=None if num_good is None else num_good * per_s,
        mean_prompt_len=num_prompt / len(ok) if ok else 0.0,
        mean_requested_prompt_len=float(np.mean([s.requested_prompt_len for s in samples])) if samples else 0.0,
        mean_output_len=num_output / len(ok) if ok else 0.0,
        send_lag_p99_ms=lag.p99_ms if lag else 0.0,
        first_error=next((_describe(s) for s in failed), None),
    )


def _describe(sample: GenSample) -> str:
    if sample.error is not None:
        return f"HTTP {sample.status}: {sample.error}" if sample.status else sample.error
    return f"HTTP {sample.status}" if sample.status else "no answer"

"""Generative bench statistics: vLLM's TTFT/TPOT/ITL/E2E definitions, throughput and goodput."""

from __future__ import annotations

import math

import pytest

from sluice.bench.generative import Calibration, GenWorkload, LengthRange, parse_length
from sluice.bench.genstats import GenSample, SloConfig, is_good, percentiles, summarize_generation


def _sample(sent: float, chunks: tuple[float, ...], num_output: int, num_prompt: int = 10, status: int = 200,
            error: str | None = None) -> GenSample:
    done = chunks[-1] if chunks else sent
    return GenSample(sent, sent, status, chunks, done, num_prompt, num_output, num_prompt, num_output, error)


def test_per_request_metrics_follow_vllm() -> None:
    s = _sample(1.0, (1.5, 1.6, 1.8, 2.1), num_output=4)
    assert s.ttft_s == pytest.approx(0.5)
    assert s.e2e_s == pytest.approx(1.1)
    assert s.tpot_s == pytest.approx((1.1 - 0.5) / 3)
    assert s.itl_s().tolist() == pytest.approx([0.1, 0.2, 0.3])
    assert math.isnan(_sample(0.0, (0.2,), num_output=1).tpot_s)  # one token: no TPOT


def test_run_summary_counts_tokens_over_the_benchmark_duration() -> None:
    samples = [_sample(0.0, (0.5, 1.0), num_output=2, num_prompt=100),
               _sample(1.0, (1.2, 1.4, 1.6, 2.0), num_output=4, num_prompt=50),
               _sample(1.5, (), num_output=0, status=503, error="busy")]
    r = summarize_generation(samples, rate_per_s=2.0, slo=SloConfig(ttft_ms=300))
    assert r.num_completed == 2 and r.num_failed == 1 and r.first_error == "HTTP 503: busy"
    assert r.duration_s == pytest.approx(2.0)  # first send (0.0) to last answer (2.0)
    assert r.output_throughput_tok_s == pytest.approx(6 / 2.0)
    assert r.total_token_throughput_tok_s == pytest.approx(156 / 2.0)
    assert r.request_throughput_per_s == pytest.approx(1.0)
    assert r.ttft is not None and r.ttft.mean_ms == pytest.approx(350)
    assert r.itl is not None and r.itl.median_ms == pytest.approx(300)  # gaps 500, 200, 200, 400
    assert r.num_good == 1 and r.goodput_per_s == pytest.approx(0.5)  # only the 200 ms TTFT meets 300 ms


def test_goodput_needs_every_set_slo_and_is_absent_without_one() -> None:
    s = _sample(0.0, (0.1, 0.3, 0.5), num_output=3)  # TTFT 100 ms, TPOT 200 ms
    assert is_good(s, SloConfig(ttft_ms=100, tpot_ms=200))
    assert not is_good(s, SloConfig(ttft_ms=100, tpot_ms=199))
    assert not is_good(s, SloConfig(ttft_ms=99))
    assert summarize_generation([s], 1.0, SloConfig()).goodput_per_s is None


def test_percentiles_ignore_nan_and_are_in_ms() -> None:
    import numpy as np

    p = percentiles(np.array([0.001, 0.002, math.nan, 0.003]))
    assert p is not None and p.median_ms == pytest.approx(2.0) and p.mean_ms == pytest.approx(2.0)
    assert percentiles(np.array([math.nan])) is None


def test_lengths_parse_as_a_number_or_a_range() -> None:
    assert parse_length("64") == LengthRange(64, 64)
    assert parse_length("32:256") == LengthRange(32, 256)
    for bad in ("0", "9:3", "a:b", "1:2:3", ""):
        with pytest.raises(ValueError):
            parse_length(bad)


def test_requests_draw_lengths_in_range_and_start_with_distinct_tags() -> None:
    workload = GenWorkload("http://x", "m", is_chat=True)
    requests = workload.requests(50, LengthRange(32, 256), LengthRange(16, 128), Calibration(4.0, 1.5), seed=3)
    assert all(32 <= r.prompt_len <= 256 and 16 <= r.output_len <= 128 for r in requests)
    assert requests == workload.requests(50, LengthRange(32, 256), LengthRange(16, 128), Calibration(4.0, 1.5), 3)
    import msgspec

    bodies = [msgspec.json.decode(r.body) for r in requests]
    assert all(b["ignore_eos"] and b["stream_options"] == {"include_usage": True} for b in bodies)
    assert [b["max_tokens"] for b in bodies] == [r.output_len for r in requests]
    first_words = [b["messages"][0]["content"].split()[0] for b in bodies]
    assert len(set(first_words)) == 50
    words = len(bodies[0]["messages"][0]["content"].split())
    assert words == Calibration(4.0, 1.5).words_for(requests[0].prompt_len)

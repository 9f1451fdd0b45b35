"""`sluice bench --endpoint completions|chat` end to end against a real server serving tiny-lm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from sluice.cli import main


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_generative_bench_streams_and_reports_vllm_metrics(demo_server, tmp_path: Path, endpoint: str) -> None:
    out = tmp_path / "gen.json"
    result = CliRunner().invoke(main, [
        "bench", "--url", demo_server.url, "--endpoint", endpoint, "--model", "tiny-lm", "--rate", "4",
        "--duration", "2", "--prompt-len", "24:64", "--output-len", "4:12", "--ttft-slo-ms", "60000",
        "--tpot-slo-ms", "60000", "--out", str(out),
    ])
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert document["format"] == "sluice-bench-generative/1"
    assert document["calibration"]["tokens_per_word"] > 0
    [run] = document["results"]
    assert run["num_scheduled"] == 8 and run["num_completed"] == 8 and run["num_failed"] == 0
    assert 4 <= run["mean_output_len"] <= 12  # ignore_eos: exactly the drawn lengths
    assert run["mean_prompt_len"] == pytest.approx(run["mean_requested_prompt_len"], rel=0.25)
    assert run["output_throughput_tok_s"] > 0
    assert run["output_throughput_tok_s"] == pytest.approx(run["total_output_tokens"] / run["duration_s"])
    for name in ("ttft", "tpot", "itl", "e2e"):
        assert 0 < run[name]["median_ms"] <= run[name]["p99_ms"]
    assert run["ttft"]["p99_ms"] <= run["e2e"]["p99_ms"]
    assert run["num_good"] == 8 and run["goodput_per_s"] == pytest.approx(run["request_throughput_per_s"])
    assert out.with_suffix(".png").stat().st_size > 0
    assert "TTFT" in result.output


def test_generative_bench_rejects_a_bad_length() -> None:
    result = CliRunner().invoke(main, ["bench", "--endpoint", "chat", "--rate", "1", "--prompt-len", "9:3"])
    assert result.exit_code == 2 and "low:high" in result.output

"""The worker's side of generation: how an engine's outcome is answered to the gateway."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sluice import wire
from sluice.clock import VirtualClock
from sluice.engines.generative.engine import RequestOutput
from sluice.engines.generative.runner import PreparedGeneration
from sluice.engines.generative.sequence import SamplingParams
from sluice.worker.generation import Generations


class _Loop:
    """What `Generations` uses of a `GenerationLoop`: its runner's `prepare`, and `submit`."""

    runner = SimpleNamespace(prepare=lambda payload: PreparedGeneration([1, 2, 3], SamplingParams()))

    def submit(self, *args: object, **kwargs: object) -> None:
        pass


def test_a_generation_the_engine_refused_is_answered_as_overload_with_retry_after():
    replies: list[wire.Message] = []
    generations = Generations(VirtualClock(0.0), lambda identity, message: replies.append(message),
                              lambda identity, request_id: None)
    submit = wire.Submit(41, "tiny", "1", wire.GeneratePayload(prompt="hi", stream=True), 5.0, "a", 1)
    assert generations.submit(7, b"gw", submit, _Loop())  # type: ignore[arg-type]
    generations.on_outputs([RequestOutput("7", (), "", True, "refused", 3, 0, 0)], 0.01)
    (result,) = [reply for reply in replies if isinstance(reply, wire.Result)]
    assert result.request_id == 41 and result.outcome is wire.Outcome.REJECTED and result.retry_after_s > 0
    assert not generations


def test_a_steps_time_is_split_by_the_tokens_it_computed_for_each_sequence():
    replies: list[wire.Message] = []
    generations = Generations(VirtualClock(0.0), lambda identity, message: replies.append(message),
                              lambda identity, request_id: None)
    for internal_id, gateway_id in ((1, 11), (2, 12)):
        submit = wire.Submit(gateway_id, "tiny", "1", wire.GeneratePayload(prompt="hi", stream=True), 5.0, "a", 1)
        assert generations.submit(internal_id, b"gw", submit, _Loop())  # type: ignore[arg-type]
    # a step of 0.1 s: 99 prompt tokens of sequence 1 (still in prefill: no output) and one decode of 2
    generations.on_outputs([RequestOutput("2", (5,), "x", False, None, 3, 0, 1)], 0.1, {"1": 99, "2": 1})
    (chunk,) = [reply for reply in replies if isinstance(reply, wire.TokenChunk)]
    assert chunk.request_id == 12 and chunk.device_s == pytest.approx(0.001)
    generations.on_outputs([RequestOutput("1", (), "", True, "deadline", 120, 0, 0)], 0.0, {})
    (expired,) = [reply for reply in replies if isinstance(reply, wire.Result)]
    assert expired.request_id == 11 and expired.device_s == pytest.approx(0.099)  # charged though it expired
    assert expired.num_tokens == 120

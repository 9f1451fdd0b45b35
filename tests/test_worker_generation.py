"""The worker's side of generation: how an engine's outcome is answered to the gateway."""

from __future__ import annotations

from types import SimpleNamespace

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

"""The worker's generation side (`Generations` + `GenerationLoop`): what the gateway hears when
the engine fails, refuses or is cut short, how a step's device time is split, and large prompts
prepared off the event loop (with a real tiny-lm engine, or hand-built engine outputs)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from sluice import wire
from sluice.clock import MonotonicClock, VirtualClock
from sluice.engines.generative.engine import RequestOutput
from sluice.engines.generative.runner import GenerativeRunner, PreparedGeneration
from sluice.engines.generative.sequence import SamplingParams
from sluice.errors import InvalidInput, Unavailable
from sluice.gateway.ticket import interpret
from sluice.priority import Priority
from sluice.repository import scan_repository
from sluice.worker import generation
from sluice.worker.generation import GenerationLoop, Generations
from tests.conftest import write_tiny_lm_model


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GenerativeRunner]:
    repo: Path = write_tiny_lm_model(tmp_path_factory.mktemp("repo"))
    (version,) = scan_repository(repo).versions
    runner = GenerativeRunner(version, "cpu")
    yield runner
    runner.close()


class _Worker:
    """Generations and a GenerationLoop on the running event loop; replies land in a queue."""

    def __init__(self, runner: GenerativeRunner) -> None:
        self.replies: asyncio.Queue[wire.Message] = asyncio.Queue()
        self.generations = Generations(MonotonicClock(), lambda _identity, message: self.replies.put_nowait(message),
                                       lambda _identity, _request_id: None)
        self.loop = GenerationLoop(runner, self.generations.on_outputs, asyncio.get_running_loop())

    def submit(self, request_id: int, priority: int = int(Priority.STANDARD), **fields: object) -> bool:
        payload = wire.GeneratePayload(**{"prompt": "hello there", "max_tokens": 4, "temperature": 0.0, **fields})
        message = wire.Submit(request_id, "tiny", "1", payload, 30.0, "t", priority)
        return self.generations.submit(request_id, b"gateway", message, self.loop)

    async def result(self) -> wire.Result:
        while True:
            message = await asyncio.wait_for(self.replies.get(), 30)
            if isinstance(message, wire.Result):
                return message


def test_an_engine_failure_is_a_503_and_the_loop_serves_the_next_request(runner, monkeypatch):
    async def scenario() -> None:
        worker = _Worker(runner)
        try:
            def broken(_inp: object) -> None:
                raise RuntimeError("device fault")

            monkeypatch.setattr(runner.engine._runner, "execute", broken)
            assert worker.submit(1)
            failed = await worker.result()
            with pytest.raises(Unavailable, match="try again"):
                interpret(runner.info, failed)
            monkeypatch.undo()
            assert worker.submit(2)
            answer = await worker.result()
            assert answer.outcome is wire.Outcome.OK and interpret(runner.info, answer).payload.num_output_tokens == 4
        finally:
            worker.loop.stop()

    asyncio.run(scenario())


def test_a_priority_class_from_a_newer_gateway_runs_as_standard_and_known_ones_are_kept(runner, monkeypatch):
    async def scenario() -> None:
        worker = _Worker(runner)
        classes: list[Priority] = []
        submit = worker.loop.submit

        def recording(sequence_id, prepared, priority, *args, **kwargs):
            classes.append(priority)
            return submit(sequence_id, prepared, priority, *args, **kwargs)

        monkeypatch.setattr(worker.loop, "submit", recording)
        try:
            for request_id, value in ((1, 7), (2, int(Priority.BATCH))):
                assert worker.submit(request_id, priority=value)
                answer = await worker.result()
                assert answer.outcome is wire.Outcome.OK
            assert classes == [Priority.STANDARD, Priority.BATCH]
        finally:
            worker.loop.stop()

    asyncio.run(scenario())


def test_a_large_prompt_is_tokenized_without_blocking_the_event_loop(runner, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    encode = runner.tokenizer.encode

    def slow_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        entered.set()
        if not release.wait(10):  # only the event loop's own thread could set it
            raise AssertionError("tokenization blocked the event loop")
        return encode(text, add_special_tokens)

    async def scenario() -> None:
        worker = _Worker(runner)
        try:
            monkeypatch.setattr(generation, "OFF_LOOP_PROMPT_CHARS", 0)
            monkeypatch.setattr(runner.tokenizer, "encode", slow_encode)
            assert worker.submit(1)
            assert await asyncio.to_thread(entered.wait, 10)
            release.set()  # the loop is free while the prompt is tokenized
            answer = await worker.result()
            assert answer.request_id == 1 and answer.outcome is wire.Outcome.OK
            # withdrawn while it is tokenized: never run, never answered
            entered.clear()
            release.clear()
            assert worker.submit(2)
            assert await asyncio.to_thread(entered.wait, 10)
            assert worker.generations.cancel(2)
            release.set()
            await asyncio.gather(*worker.generations._preparing)
            assert worker.submit(3, prompt="x")
            assert (await worker.result()).request_id == 3
            assert not worker.generations and not runner.engine.has_unfinished()
        finally:
            worker.loop.stop()

    asyncio.run(scenario())


def test_a_prompt_far_longer_than_the_context_is_refused_untokenized(runner, monkeypatch):
    def no_encode(*_args: object, **_kwargs: object) -> list[int]:
        raise AssertionError("a prompt that cannot fit was tokenized")

    async def scenario() -> None:
        worker = _Worker(runner)
        try:
            monkeypatch.setattr(runner.tokenizer, "encode", no_encode)
            assert worker.submit(1, prompt="word " * 3_000_000)
            refused = await worker.result()
            with pytest.raises(InvalidInput, match="characters"):
                interpret(runner.info, refused)
            assert refused.errors[0].param == "prompt"
        finally:
            worker.loop.stop()

    asyncio.run(scenario())


def _runner(prepare: Callable[[wire.GeneratePayload], object]) -> SimpleNamespace:
    """What `Generations` uses of a `GenerativeRunner`: `prepare`, and its model's reasoning parser."""
    return SimpleNamespace(prepare=prepare, info=SimpleNamespace(reasoning_parser=""))


class _Loop:
    """What `Generations` uses of a `GenerationLoop`: its runner's `prepare`, and `submit`."""

    runner = _runner(lambda payload: PreparedGeneration([1, 2, 3], SamplingParams()))

    def submit(self, *args: object, **kwargs: object) -> None:
        pass


def test_a_generation_the_engine_refused_is_answered_as_overload_with_retry_after():
    replies: list[wire.Message] = []
    generations = Generations(VirtualClock(0.0), lambda identity, message: replies.append(message),
                              lambda identity, request_id: None)
    submit = wire.Submit(41, "tiny", "1", wire.GeneratePayload(prompt="hi", stream=True), 5.0, "a", 1)
    assert generations.submit(7, b"gw", submit, _Loop())  # type: ignore[arg-type]
    generations.on_outputs([RequestOutput("7", (), "", True, "refused", 3, 0, 0, retry_after_s=0.35)], 0.01, {})
    (result,) = [reply for reply in replies if isinstance(reply, wire.Result)]
    assert result.request_id == 41 and result.outcome is wire.Outcome.REJECTED
    assert result.retry_after_s == pytest.approx(0.35)  # when the engine would take it
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


def test_a_refused_generation_is_counted_as_the_device_time_it_would_have_used():
    refused: list[tuple[str, str, float]] = []
    generations = Generations(VirtualClock(0.0), lambda identity, message: None, lambda identity, request_id: None,
                              lambda model, version, seconds: refused.append((model, version, seconds)))

    def submit(internal_id: int, max_tokens: int) -> None:
        payload = wire.GeneratePayload(prompt="hi", max_tokens=max_tokens)
        loop = _Loop()
        prepared = PreparedGeneration([1, 2, 3], SamplingParams(max_tokens=max_tokens))
        loop.runner = _runner(lambda _: prepared)
        assert generations.submit(internal_id, b"gw", wire.Submit(internal_id, "tiny", "1", payload, 5.0, "a", 1),
                                  loop)  # type: ignore[arg-type]

    submit(1, 40)
    # two steps of 10 ms, 50 tokens each: 0.2 ms per computed token; the request stops at 10 of its 40 tokens
    generations.on_outputs([], 0.01, {"1": 50})
    generations.on_outputs([RequestOutput("1", (7,), "x", True, "stop", 3, 0, 10)], 0.01, {"1": 50})
    submit(2, 100)
    generations.on_outputs([RequestOutput("2", (), "", True, "refused", 60, 0, 0)], 0.0, {})
    # 60 prompt tokens and a quarter of its 100 tokens, as the finished one used, at 0.2 ms each
    assert refused == [("tiny", "1", pytest.approx(0.0002 * (60 + 25)))]


def test_a_request_whose_preparation_fails_unexpectedly_is_answered_and_not_kept():
    replies: list[wire.Message] = []
    generations = Generations(VirtualClock(0.0), lambda identity, message: replies.append(message),
                              lambda identity, request_id: None)

    class Broken(_Loop):
        runner = _runner(lambda payload: 1 / 0)

    submit = wire.Submit(41, "tiny", "1", wire.GeneratePayload(prompt="hi"), 5.0, "a", 1)
    assert not generations.submit(7, b"gw", submit, Broken())  # type: ignore[arg-type]
    (result,) = replies
    assert isinstance(result, wire.Result) and result.outcome is wire.Outcome.FAILED
    assert result.errors[0].is_transient  # a 503: not the client's fault
    assert not generations  # nothing left registered: a drain can finish


class _RecordingLoop(_Loop):
    """A `_Loop` that keeps what was submitted (engine id, parameters, prefix_of) and aborted."""

    def __init__(self) -> None:
        self.submitted: list[tuple[str, SamplingParams, object]] = []
        self.aborted: list[str] = []

    def submit(self, request_id: str, prepared: PreparedGeneration, *args: object, **kwargs: object) -> None:
        self.submitted.append((request_id, prepared.params, kwargs.get("prefix_of")))

    def abort(self, request_ids: list[str]) -> None:
        self.aborted += request_ids


def test_n_choices_run_as_seeded_sequences_and_are_answered_once_all_have_ended():
    replies: list[wire.Message] = []
    generations = Generations(VirtualClock(0.0), lambda identity, message: replies.append(message),
                              lambda identity, request_id: None)
    loop = _RecordingLoop()
    loop.runner = _runner(lambda _: PreparedGeneration([1, 2, 3], SamplingParams(seed=2**63 - 2)))
    payload = wire.GeneratePayload(prompt="hi", n=3)
    assert generations.submit(5, b"gw", wire.Submit(50, "tiny", "1", payload, 5.0, "a", 1), loop)  # type: ignore[arg-type]
    assert [(rid, params.seed, prefix_of) for rid, params, prefix_of in loop.submitted] == [
        ("5", 2**63 - 2, None), ("5/1", 2**63 - 1, "5"), ("5/2", -(2**63), "5")]  # seeds wrap within 64 bits
    generations.on_outputs([RequestOutput("5/1", (8,), "b", True, "length", 3, 0, 1),
                            RequestOutput("5", (7,), "a", True, "stop", 3, 0, 1)], 0.01, {"5": 1, "5/1": 1})
    assert not [reply for reply in replies if isinstance(reply, wire.Result)]  # choice 2 still runs
    generations.on_outputs([RequestOutput("5/2", (9, 9), "cc", True, "length", 3, 0, 2)], 0.01, {"5/2": 2})
    (result,) = [reply for reply in replies if isinstance(reply, wire.Result)]
    payload_out = result.payload
    assert isinstance(payload_out, wire.GenerationResult)
    assert (payload_out.text, payload_out.finish_reason, payload_out.num_output_tokens) == ("a", "stop", 4)
    assert [(c.text, c.finish_reason) for c in payload_out.choices] == [("b", "length"), ("cc", "length")]
    assert result.num_tokens == 3 + 4 and not loop.aborted and not generations


def test_a_choice_that_fails_ends_the_request_and_withdraws_the_others():
    replies: list[wire.Message] = []
    generations = Generations(VirtualClock(0.0), lambda identity, message: replies.append(message),
                              lambda identity, request_id: None)
    loop = _RecordingLoop()
    payload = wire.GeneratePayload(prompt="hi", n=3, stream=True)
    assert generations.submit(6, b"gw", wire.Submit(60, "tiny", "1", payload, 5.0, "a", 1), loop)  # type: ignore[arg-type]
    generations.on_outputs([RequestOutput("6/2", (4,), "x", True, "length", 3, 0, 1)], 0.01, {"6/2": 1})
    generations.on_outputs([RequestOutput("6/1", (), "", True, "error", 3, 0, 0)], 0.01, {"6/1": 1})
    (result,) = [reply for reply in replies if isinstance(reply, wire.Result)]
    assert result.outcome is wire.Outcome.FAILED and result.request_id == 60
    assert loop.aborted == ["6"]  # the one still running; choice 2 had ended
    (chunk,) = [reply for reply in replies if isinstance(reply, wire.TokenChunk)]
    assert chunk.index == 2 and chunk.text == "x" and not chunk.is_last  # the other choices were running
    assert not generations


def test_a_streamed_generations_chunk_that_ends_it_by_stop_or_length_says_it_is_the_last():
    """The gateway marks that answer final (Triton's `triton_final_response`) from it."""
    replies: list[wire.Message] = []
    generations = Generations(VirtualClock(0.0), lambda identity, message: replies.append(message),
                              lambda identity, request_id: None)
    for internal_id in (1, 2):
        submit = wire.Submit(internal_id, "tiny", "1", wire.GeneratePayload(prompt="hi", stream=True), 5.0, "a", 1)
        assert generations.submit(internal_id, b"gw", submit, _Loop())  # type: ignore[arg-type]
    generations.on_outputs([RequestOutput("1", (5,), "a", False, None, 3, 0, 1),
                            RequestOutput("2", (6,), "b", False, None, 3, 0, 1)], 0.01, {"1": 1, "2": 1})
    generations.on_outputs([RequestOutput("1", (7,), "", True, "stop", 3, 0, 2),
                            RequestOutput("2", (8,), "c", False, None, 3, 0, 2)], 0.01, {"1": 1, "2": 1})
    chunks = [(reply.request_id, reply.text, reply.is_last) for reply in replies if isinstance(reply, wire.TokenChunk)]
    assert chunks == [(1, "a", False), (2, "b", False), (1, "", True), (2, "c", False)]


@pytest.mark.parametrize(("setting", "refusal"), [
    ('tool_call_parser = "llama9"', "tool_call_parser must be one of 'hermes'"),
    ('reasoning_parser = "o1"', "reasoning_parser must be one of 'deepseek_r1', 'qwen3', got 'o1'"),
])
def test_an_unknown_parser_refuses_the_model_with_the_choices(tmp_path: Path, setting: str, refusal: str):
    from sluice.errors import ConfigError

    repo = write_tiny_lm_model(tmp_path / "repo")
    toml = next(repo.glob("*/model.toml"))
    toml.write_text(toml.read_text() + setting + "\n")
    (version,) = scan_repository(repo).versions
    with pytest.raises(ConfigError, match=refusal):
        GenerativeRunner(version, "cpu")


def test_a_reasoning_models_chat_reports_the_tokens_it_thought_with():
    """Counted as the tokens come, for a chat: the opening tag spelt in two tokens counts with the
    thoughts, the closing one, a token of its own, does not (as vLLM counts); a completion of the
    same model has no thoughts apart, so none."""
    replies: list[wire.Message] = []
    generations = Generations(VirtualClock(0.0), lambda identity, message: replies.append(message),
                              lambda identity, request_id: None)
    loop = _Loop()
    loop.runner = SimpleNamespace(prepare=lambda _: PreparedGeneration([1, 2, 3], SamplingParams()),
                                  info=SimpleNamespace(reasoning_parser="qwen3"))
    chat = wire.GeneratePayload(messages=[wire.ChatMessage("user", "hi")])
    for internal_id, payload in ((1, chat), (2, wire.GeneratePayload(prompt="hi"))):
        assert generations.submit(internal_id, b"gw", wire.Submit(internal_id, "tiny", "1", payload, 5.0, "a", 1),
                                  loop)  # type: ignore[arg-type]
    for step, text in enumerate(["<th", "ink>", "hmm", "</think>", "Yes"], start=1):
        generations.on_outputs([RequestOutput(str(i), (9,), text, step == 5, "stop" if step == 5 else None, 3, 0, step)
                                for i in (1, 2)], 0.01, {"1": 1, "2": 1})
    results = {reply.request_id: reply.payload for reply in replies if isinstance(reply, wire.Result)}
    assert isinstance(results[1], wire.GenerationResult) and isinstance(results[2], wire.GenerationResult)
    assert (results[1].num_reasoning_tokens, results[1].num_output_tokens) == (3, 5)
    assert results[1].text == results[2].text == "<think>hmm</think>Yes"  # the gateway splits the text
    assert results[2].num_reasoning_tokens == 0

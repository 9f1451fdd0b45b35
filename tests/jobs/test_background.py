"""Background responses' runner (`jobs.background`) on both real stores, with a stand-in app: a
run's status goes queued → in_progress → its end; refusals that say to wait are waited out; a run
left by a stopped gateway is taken over once its lease runs out; a cancelled run's work stops and
its late answer is not written."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import msgspec
import pytest

from sluice.jobs.background import BackgroundResponses, RunRequest
from sluice.jobs.store import JobStore

NOW = int(time.time())  # responses older than their retention (30 days) are purged
QUEUED = {"id": "resp_1", "object": "response", "status": "queued", "background": True, "output": [],
          "usage": None, "error": None, "incomplete_details": None, "metadata": {"k": "v"}}
ANSWER = {"id": "resp_inner", "status": "completed", "output": [{"type": "message", "content": "hi"}],
          "usage": {"output_tokens": 3}, "incomplete_details": None, "store": False}


class App:
    """Answers POST /v1/responses with `answers` in turn (status, body, headers), the last one
    for good; `hold` keeps a call waiting until it is set (or the call is cancelled)."""

    def __init__(self, *answers: tuple[int, Any, dict[str, str]], held: bool = False) -> None:
        self.answers = list(answers) or [(200, ANSWER, {})]
        self.calls: list[dict[str, Any]] = []
        self.hold: asyncio.Event | None = asyncio.Event() if held else None
        self.between: asyncio.Event | None = None
        self.cancelled = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = (await receive())["body"]
        self.calls.append({"body": json.loads(body), "tenant": scope["sluice.tenant"],
                           "headers": dict((k.decode(), v.decode()) for k, v in scope["headers"])})
        if self.hold is not None:
            try:
                await self.hold.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        status, answer, headers = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        await send({"type": "http.response.start", "status": status,
                    "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})
        if isinstance(answer, list):  # a stream's events, one body message each
            for i, (kind, fields) in enumerate(answer):
                event = f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': i, **fields})}\n\n"
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
                if self.between is not None:
                    await self.between.wait()
            await send({"type": "http.response.body", "body": b""})
            return
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})


async def _started(store: JobStore, app: App, **options: Any) -> BackgroundResponses:
    """A gateway's runner, running through `app`."""
    runner = BackgroundResponses(store, **options)
    await runner.start(app)
    return runner


def _request(response_id: str = "resp_1", stream: bool = False) -> RunRequest:
    return RunRequest(b'{"model": "tiny", "input": "Hi", "background": false}', [("x-sluice-priority", "batch")],
                      msgspec.json.encode({**QUEUED, "id": response_id}), stream)


async def _body(store: JobStore, response_id: str = "resp_1") -> dict[str, Any]:
    found = await store.get_response("acme", response_id)
    assert found is not None
    return json.loads(found.body)


async def _until(store: JobStore, status: str, response_id: str = "resp_1", timeout_s: float = 10) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while (body := await _body(store, response_id))["status"] != status:
        assert time.monotonic() < deadline, f"still {body['status']}, never {status}"
        await asyncio.sleep(0.01)
    return body


async def test_a_run_goes_queued_in_progress_then_ends_with_the_answer(store: JobStore):
    app = App(held=True)
    runner = await _started(store, app)
    await runner.submit("acme", "resp_1", NOW, _request(), b'[{"role": "user"}]')
    running = await _until(store, "in_progress")
    assert running["metadata"] == {"k": "v"} and running["output"] == []
    app.hold.set()
    done = await _until(store, "completed")
    assert done == {**QUEUED, "status": "completed", "output": ANSWER["output"], "usage": ANSWER["usage"]}
    assert done["id"] == "resp_1" and done["background"] is True, "the queued object, not the inner one"
    [made] = app.calls
    assert made["tenant"] == "acme" and made["headers"]["x-sluice-priority"] == "batch"
    assert made["body"] == {"model": "tiny", "input": "Hi", "background": False}
    await runner.aclose()


async def test_refusals_that_say_wait_are_waited_out_and_others_fail_the_response(store: JobStore):
    busy = (503, {"error": {"message": "overloaded", "code": "overloaded"}}, {"retry-after-ms": "20"})
    app = App(busy, busy, (200, ANSWER, {}))
    runner = await _started(store, app)
    await runner.submit("acme", "resp_1", NOW, _request(), b"[]")
    assert (await _until(store, "completed"))["output"] == ANSWER["output"] and len(app.calls) == 3

    bad = App((400, {"error": {"message": "'input' is too long", "code": "context_length_exceeded"}}, {}))
    spent = App((429, {"error": {"message": "budget spent", "code": "budget_exhausted"}},
                 {"retry-after": "1", "x-should-retry": "false"}))
    # error.code takes the values OpenAI's Responses API gives it; the message keeps ours
    for app, code, message in [(bad, "invalid_prompt", "'input' is too long"),
                               (spent, "rate_limit_exceeded", "budget spent")]:
        runner._app = app
        response_id = f"resp_{code}"
        await runner.submit("acme", response_id, NOW, _request(response_id), b"[]")
        failed = await _until(store, "failed", response_id)
        assert failed["error"] == {"code": code, "message": message} and len(app.calls) == 1
    await runner.aclose()


async def test_a_stopped_gateways_run_is_taken_over_once_its_lease_runs_out(store: JobStore):
    stuck = App(held=True)
    first = await _started(store, stuck, lease_s=30)
    await first.submit("acme", "resp_1", NOW, _request(), b"[]")
    await _until(store, "in_progress")
    await first.aclose()  # stops without an answer: the run stays, leased for 30 s
    assert stuck.cancelled == 1

    app = App()
    now = time.time()
    early = await _started(store, app, lease_s=30, clock=lambda: now + 5)
    await asyncio.sleep(0.2)
    assert app.calls == [] and (await _body(store))["status"] == "in_progress", "the lease is still live"
    await early.aclose()

    later = await _started(store, app, lease_s=30, clock=lambda: now + 31)
    assert (await _until(store, "completed"))["output"] == ANSWER["output"] and len(app.calls) == 1
    await later.aclose()


async def test_a_run_started_too_often_ends_failed_without_running_again(store: JobStore):
    await store.put_response_run("acme", "resp_1", NOW, msgspec.json.encode(QUEUED), b"[]",
                                 msgspec.json.encode(_request()), "gw-dead", 0.0)
    app = App()
    runner = BackgroundResponses(store, max_attempts=1)  # this claim is its second start
    await runner.start(app)
    failed = await _until(store, "failed")
    assert failed["error"]["code"] == "server_error" and app.calls == []
    await runner.aclose()


async def test_a_run_cancelled_elsewhere_stops_its_work_and_stays_cancelled(store: JobStore):
    app = App(held=True)
    runner = await _started(store, app, check_s=0.1)
    await runner.submit("acme", "resp_1", NOW, _request(), b"[]")
    await _until(store, "in_progress")
    # cancelled through another gateway: this one learns it at its next renewal and stops the work
    assert await store.cancel_response_run("acme", "resp_1", msgspec.json.encode({**QUEUED, "status": "cancelled"}))
    deadline = time.monotonic() + 5
    while app.cancelled == 0:
        assert time.monotonic() < deadline, "the cancelled run's work went on"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)
    assert (await _body(store))["status"] == "cancelled"
    await runner.aclose()


async def test_beyond_its_room_a_gateway_leaves_new_runs_queued_for_later(store: JobStore):
    app = App(held=True)
    runner = await _started(store, app, max_running=1)
    await runner.submit("acme", "resp_1", NOW, _request("resp_1"), b"[]")
    await runner.submit("acme", "resp_2", NOW, _request("resp_2"), b"[]")

    async def statuses() -> list[str]:
        return sorted([(await _body(store, "resp_1"))["status"], (await _body(store, "resp_2"))["status"]])

    deadline = time.monotonic() + 10
    while await statuses() != ["in_progress", "queued"]:  # which one runs first is not promised
        assert time.monotonic() < deadline, await statuses()
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)
    assert await statuses() == ["in_progress", "queued"] and len(app.calls) == 1, "one at a time"
    app.hold.set()
    await _until(store, "completed", "resp_1")
    await _until(store, "completed", "resp_2")
    assert len(app.calls) == 2
    await runner.aclose()
    assert await store.claim_response_runs("gw-x", time.time() + 99, time.time() + 130, 9) == []


async def test_a_run_left_for_lack_of_room_counts_its_first_start_when_claimed(store: JobStore):
    await store.put_response_run("acme", "resp_1", NOW, msgspec.json.encode(QUEUED), b"[]",
                                 msgspec.json.encode(_request()), "", 0.0)
    [claimed] = await store.claim_response_runs("gw-1", time.time(), time.time() + 30, 9)
    assert claimed.attempts == 1, "not a restart"


STREAM = [("response.created", {"response": {"id": "resp_inner", "status": "in_progress"}}),
          ("response.in_progress", {"response": {"id": "resp_inner", "status": "in_progress"}}),
          ("response.output_text.delta", {"item_id": "msg_1", "output_index": 0, "delta": "Hel"}),
          ("response.output_text.delta", {"item_id": "msg_1", "output_index": 0, "delta": "lo"}),
          ("response.completed", {"response": ANSWER})]


def _events(raw: list[bytes]) -> list[dict[str, Any]]:
    events = []
    for event in raw:
        kind_line, data_line = event.decode().strip().split("\n")
        event_data = json.loads(data_line.removeprefix("data: "))
        assert kind_line == f"event: {event_data['type']}"
        events.append(event_data)
    return events


async def _read(runner: BackgroundResponses, after: int = -1, response_id: str = "resp_1") -> list[dict[str, Any]]:
    return _events([event async for event in runner.follow("acme", response_id, after)])


async def test_a_streamed_run_is_followed_live_here_and_from_the_store_elsewhere(store: JobStore):
    app = App((200, STREAM, {}))
    app.between = asyncio.Event()
    runner = await _started(store, app)
    await runner.submit("acme", "resp_1", NOW, _request(stream=True), b"[]")
    elsewhere = BackgroundResponses(store)  # another gateway's view: it does not run it
    reading_here = asyncio.create_task(_read(runner))
    reading_elsewhere = asyncio.create_task(_read(elsewhere))
    await asyncio.sleep(0.3)
    assert not reading_here.done() and not reading_elsewhere.done(), "readers wait for the stream's end"
    app.between.set()
    here, there = await asyncio.wait_for(asyncio.gather(reading_here, reading_elsewhere), 10)
    assert here == there
    assert [e["type"] for e in here] == ["response.created", "response.queued", "response.in_progress",
                                         "response.output_text.delta", "response.output_text.delta",
                                         "response.completed"]
    assert [e["sequence_number"] for e in here] == list(range(6))
    assert here[0]["response"]["status"] == "queued" and here[2]["response"]["status"] == "in_progress"
    assert all(e["response"]["id"] == "resp_1" for e in here if "response" in e), "the background response's own"
    assert here[-1]["response"] == await _body(store) == {**QUEUED, "status": "completed", "output": ANSWER["output"],
                                                           "usage": ANSWER["usage"]}
    assert await _read(runner, after=3) == here[4:], "resumed after an event: the rest"
    assert await _read(elsewhere, after=5) == []
    await runner.aclose()


async def test_a_streamed_run_that_fails_mid_stream_ends_with_response_failed(store: JobStore):
    broken = [*STREAM[:3], ("error", {"code": "server_error", "message": "worker lost"})]
    runner = BackgroundResponses(store)
    await runner.start(App((200, broken, {})))
    await runner.submit("acme", "resp_1", NOW, _request(stream=True), b"[]")
    events = await asyncio.wait_for(_read(runner), 10)
    assert [e["type"] for e in events][-3:] == ["response.output_text.delta", "error", "response.failed"]
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "worker lost"}
    assert (await _body(store))["status"] == "failed"
    await runner.aclose()


async def test_a_cancelled_streamed_run_ends_its_readers(store: JobStore):
    app = App((200, STREAM, {}))
    app.between = asyncio.Event()
    runner = await _started(store, app, check_s=0.1)
    await runner.submit("acme", "resp_1", NOW, _request(stream=True), b"[]")
    elsewhere = BackgroundResponses(store)
    reading_here, reading_elsewhere = asyncio.create_task(_read(runner)), asyncio.create_task(_read(elsewhere))
    await asyncio.sleep(0.3)
    assert await store.cancel_response_run("acme", "resp_1", msgspec.json.encode({**QUEUED, "status": "cancelled"}))
    here, there = await asyncio.wait_for(asyncio.gather(reading_here, reading_elsewhere), 10)
    assert [e["type"] for e in here][:3] == ["response.created", "response.queued", "response.in_progress"]
    assert "response.completed" not in [e["type"] for e in here + there]
    await runner.aclose()


def _event(kind: str, seq: int, **fields: Any) -> tuple[int, bytes]:
    return seq, f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **fields})}\n\n".encode()


async def test_a_taken_over_stream_closes_the_earlier_items_and_numbers_its_own_after_them(store: JobStore):
    from sluice.jobs.background import TAKEOVER_GAP

    message = {"type": "message", "id": "msg_old", "status": "in_progress", "role": "assistant", "content": []}
    earlier = [_event("response.created", 0, response=QUEUED), _event("response.queued", 1, response=QUEUED),
               _event("response.in_progress", 2, response={**QUEUED, "status": "in_progress"}),
               _event("response.output_item.added", 3, output_index=0, item=message),
               _event("response.output_text.delta", 4, item_id="msg_old", output_index=0, delta="Hel")]
    await store.put_response_run("acme", "resp_1", NOW, msgspec.json.encode(QUEUED), b"[]",
                                 msgspec.json.encode(_request(stream=True)), "gw-dead", 0.0, earlier)
    new_message = {**message, "id": "msg_new"}
    app = App((200, [*STREAM[:2], ("response.output_item.added", {"output_index": 0, "item": new_message}),
                     ("response.output_text.delta", {"item_id": "msg_new", "output_index": 0, "delta": "Hello"}),
                     ("response.output_item.done", {"output_index": 0, "item": {**new_message, "status": "done"}}),
                     STREAM[-1]], {}))
    runner = await _started(store, app)  # the earlier gateway is gone: this one takes the run over
    events = await asyncio.wait_for(_read(runner), 10)
    assert [(e["type"], e.get("output_index")) for e in events] == [
        ("response.created", None), ("response.queued", None), ("response.in_progress", None),
        ("response.output_item.added", 0), ("response.output_text.delta", 0),
        ("response.output_item.done", 0), ("response.in_progress", None),  # the takeover's
        ("response.output_item.added", 1), ("response.output_text.delta", 1), ("response.output_item.done", 1),
        ("response.completed", None)]
    assert events[5]["item"] == {**message, "status": "incomplete"}, "the earlier start's item, left unfinished"
    assert events[7]["item"]["id"] == "msg_new"
    numbers = [e["sequence_number"] for e in events]
    assert numbers == [*range(5), *range(5 + TAKEOVER_GAP, 11 + TAKEOVER_GAP)]
    assert await _read(runner, after=4) == events[5:], "resumed after the last stored event: the takeover's"
    assert await _read(runner, after=4 + 3) == events[5:], "after events never stored: the takeover's too"
    assert (await _body(store))["output"] == ANSWER["output"], "the answer is the new start's alone"
    await runner.aclose()


async def test_a_tenant_with_too_many_unanswered_background_responses_is_refused_more(store: JobStore):
    from sluice.errors import RateLimited

    app = App(held=True)
    runner = await _started(store, app, max_per_tenant=2)
    for response_id in ("resp_1", "resp_2"):
        await runner.submit("acme", response_id, NOW, _request(response_id), b"[]")
    with pytest.raises(RateLimited) as refused:
        await runner.submit("acme", "resp_3", NOW, _request("resp_3"), b"[]")
    assert refused.value.limit == "background" and refused.value.retry_after_s
    await runner.submit("zeta", "resp_z", NOW, _request("resp_z"), b"[]")  # another tenant's count
    app.hold.set()
    await _until(store, "completed", "resp_1")
    await _until(store, "completed", "resp_2")
    await runner.submit("acme", "resp_3", NOW, _request("resp_3"), b"[]")  # answered ones leave room
    await _until(store, "completed", "resp_3")
    await runner.aclose()


async def test_a_runner_stops_when_asked_even_as_a_wake_up_arrives(store: JobStore):
    for turns_between in range(4):  # the ended run's wake-up and the stop, in either order
        runner = await _started(store, App())
        await asyncio.sleep(0.05)
        runner._wake.set()
        for _ in range(turns_between):
            await asyncio.sleep(0)
        async with asyncio.timeout(5):
            await runner.aclose()

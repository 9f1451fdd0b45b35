"""A request large enough to take long to prepare (tokenize) is prepared on a thread: the event
loop, which sends the worker's liveness reports, keeps turning meanwhile; a Cancel withdraws the
request while it is prepared, and draining waits for it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from sluice import wire
from sluice.clock import MonotonicClock
from sluice.metrics import WorkerMetrics
from sluice.worker.batches import OFF_LOOP_TEXT_CHARS
from sluice.worker.device import DeviceThread
from sluice.worker.main import WorkerConfig, load_models
from sluice.worker.server import WorkerServer
from tests.conftest import write_emulated_model

PREPARE_S = 0.6
NUM_TEXTS = 8
TEXT_CHARS = OFF_LOOP_TEXT_CHARS // 4  # twice the limit in all


def _server(tmp_path: Path) -> tuple[WorkerServer, list[wire.Message]]:
    """A worker whose emulated model takes PREPARE_S to prepare the large request; no listener,
    its replies collected."""
    kchars = NUM_TEXTS * TEXT_CHARS / 1000
    write_emulated_model(tmp_path / "models", slo_ms=5000, alpha_ms=1.0, beta_ms=0.1,
                         prepare_ms_per_kchar=PREPARE_S * 1000 / kchars)
    models, _, _ = load_models(WorkerConfig("w", "inproc://w", tmp_path / "models"))
    server = WorkerServer("w", models, [], MonotonicClock(), WorkerMetrics("w"))
    replies: list[wire.Message] = []
    server._outbox.reply = lambda identity, message: replies.append(message)  # type: ignore[method-assign]
    server._outbox.flush = lambda: None  # type: ignore[method-assign]
    return server, replies


def _submit(request_id: int, num_texts: int, text_chars: int) -> wire.Submit:
    texts = [f"{i:03d}" + "x" * (text_chars - 3) for i in range(num_texts)]
    return wire.Submit(request_id, "emulated", "1", wire.TextPayload(texts), 5.0, "", 1)


async def _max_lag_s(until: asyncio.Event) -> float:
    worst = 0.0
    while not until.is_set():
        started = time.monotonic()
        await asyncio.sleep(0.01)
        worst = max(worst, time.monotonic() - started - 0.01)
    return worst


def _answers(replies: list[wire.Message]) -> dict[int, wire.Result]:
    return {reply.request_id: reply for reply in replies if isinstance(reply, wire.Result)}


def test_a_large_request_is_prepared_off_the_loop_and_others_are_served_meanwhile(tmp_path: Path) -> None:
    server, replies = _server(tmp_path)

    async def converse() -> float:
        server._batches.device = DeviceThread(server._scheduler, server._lock, server._table.runners,
                                              server._batches.prepared_items, server._on_batch_done,
                                              asyncio.get_running_loop())
        done = asyncio.Event()
        lag = asyncio.create_task(_max_lag_s(done))
        server._on_submit(b"gw", _submit(1, NUM_TEXTS, TEXT_CHARS))
        assert not _answers(replies)  # not prepared yet: it went to a thread
        server._on_submit(b"gw", _submit(2, 1, 10))  # small: prepared at once, run at once
        while 1 not in _answers(replies):
            await asyncio.sleep(0.01)
        done.set()
        server._batches.device.stop()
        return await lag

    started = time.monotonic()
    max_lag_s = asyncio.run(converse())
    answers = _answers(replies)
    assert answers[1].outcome == wire.Outcome.OK and answers[2].outcome == wire.Outcome.OK
    assert isinstance(answers[1].payload, wire.TensorPayload) and answers[1].payload.shape[0] == NUM_TEXTS
    assert time.monotonic() - started >= PREPARE_S
    assert max_lag_s < PREPARE_S / 3  # inline, the loop stalled for all of PREPARE_S


def test_a_request_cancelled_while_prepared_is_dropped_and_draining_waits_for_it(tmp_path: Path) -> None:
    server, replies = _server(tmp_path)

    async def converse() -> tuple[bool, float]:
        started = time.monotonic()
        server._on_submit(b"gw", _submit(1, NUM_TEXTS, TEXT_CHARS))
        server._on_cancel(b"gw", wire.Cancel([1]))
        server.drain()
        drained_while_preparing = server._drained.is_set()
        await asyncio.wait_for(server._drained.wait(), 10 * PREPARE_S)
        return drained_while_preparing, time.monotonic() - started

    drained_while_preparing, drained_after_s = asyncio.run(converse())
    assert not drained_while_preparing  # its thread still holds the model's runner
    assert drained_after_s >= PREPARE_S
    assert not _answers(replies)  # withdrawn: nothing to answer

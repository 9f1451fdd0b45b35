"""A real worker process's reports to a gateway, over the real link: which of that gateway's
requests each report already counts, and what a newcomer's own batch adds to its wait."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from sluice import transport, wire
from tests.conftest import free_port, write_emulated_model


def test_each_report_names_the_last_request_it_counts(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    write_emulated_model(repo, slo_ms=5000)
    address = f"tcp://127.0.0.1:{free_port()}"
    worker = subprocess.Popen([sys.executable, "-m", "sluice", "worker", "--bind", address, "--models", str(repo)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        asyncio.run(asyncio.wait_for(_converse(address), 120))
    finally:
        worker.kill()
        worker.wait()


async def _converse(address: str) -> None:
    states: asyncio.Queue[wire.WorkerState] = asyncio.Queue()
    results: asyncio.Queue[wire.Result] = asyncio.Queue()

    def on_frame(data: bytes) -> None:
        for message in wire.decode(data):
            if isinstance(message, wire.WorkerState):
                states.put_nowait(message)
            elif isinstance(message, wire.Result):
                results.put_nowait(message)

    def introduce() -> None:
        channel.send(wire.encode_many([wire.Hello("gw-test")]))

    channel = transport.Channel(address, b"gw-test", on_frame, introduce)
    channel.start()
    try:
        state = await states.get()
        while not state.is_ready:
            state = await states.get()
        assert state.seen_request_id == 0
        payload = wire.TensorPayload("float32", (1, 16), bytes(64))
        submits = [wire.Submit(request_id, "emulated", "1", payload, 5.0, "", 1) for request_id in (41, 42)]
        assert channel.send(wire.encode_many(submits))
        for _ in submits:
            assert (await results.get()).outcome == wire.Outcome.OK
        while not states.empty():  # reports that came before the answers (built before the submits, or
            assert states.get_nowait().seen_request_id in (0, 41, 42)  # while they queued or ran)
        state = await states.get()  # built after both were answered
        assert state.seen_request_id == 42 and not state.work_ahead_s
        (queue,) = state.queues
        # an idle device: a newcomer's own batch is one row's time, 8.5 ms by the model's profile
        # (behind queued rows it would only add its share of their batch)
        assert 0.004 < queue.newcomer_s < 0.03
    finally:
        await channel.aclose()

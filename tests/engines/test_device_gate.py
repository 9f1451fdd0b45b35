"""The device gate: a CUDA graph's recording has the device to itself, without starving behind
a stream of steps, and a thread cannot wait for itself."""

from __future__ import annotations

import threading
import time

import pytest

from sluice.engines.device_gate import DeviceGate


def _started(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_a_recording_waits_for_the_running_steps_and_the_next_steps_wait_for_it():
    gate = DeviceGate()
    log: list[str] = []
    step_running, end_step, recording = threading.Event(), threading.Event(), threading.Event()

    def step() -> None:
        with gate.shared():
            step_running.set()
            end_step.wait(5)
            log.append("first step ends")

    def record() -> None:
        with gate.exclusive():
            recording.set()
            log.append("recording")
            time.sleep(0.05)
            log.append("recorded")

    def later_step() -> None:
        with gate.shared():
            log.append("later step")

    first = _started(step)
    assert step_running.wait(5)
    recorder = _started(record)
    deadline = time.monotonic() + 5
    while gate._writers_waiting == 0 and time.monotonic() < deadline:  # the recorder waits for the first step
        time.sleep(0.001)
    later = _started(later_step)  # arrives while the recorder waits: goes after it
    time.sleep(0.05)
    assert log == [] and not recording.is_set()
    end_step.set()
    for thread in (first, recorder, later):
        thread.join(5)
    assert log == ["first step ends", "recording", "recorded", "later step"]


def test_steps_share_the_gate_and_a_thread_holding_it_may_take_it_again():
    gate = DeviceGate()
    inside = threading.Barrier(2, timeout=5)

    def step() -> None:
        with gate.shared():
            inside.wait()  # both steps are inside at once
            with gate.shared():  # e.g. a model closed from within a step
                pass

    threads = [_started(step) for _ in range(2)]
    for thread in threads:
        thread.join(5)
    assert not any(t.is_alive() for t in threads)
    with gate.exclusive():  # nothing left held
        pass


def test_asking_for_it_exclusively_while_holding_it_shared_is_an_error_not_a_hang():
    gate = DeviceGate()
    with gate.shared(), pytest.raises(RuntimeError, match="cannot wait for itself"), gate.exclusive():
        pass
    with gate.exclusive():  # the failed ask left nothing behind
        pass

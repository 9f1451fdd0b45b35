"""Helpers shared by the scheduler tests: driving a scheduler under a virtual clock."""

from __future__ import annotations

from sluice.clock import VirtualClock
from sluice.scheduler import Batch, Scheduler


def run(scheduler: Scheduler, clock: VirtualClock) -> Batch | None:
    """Form the next batch, run it for exactly its predicted time, and report it done."""
    batch = scheduler.next_batch().batch
    if batch is not None:
        clock.advance(batch.predicted_s)
        scheduler.batch_done(batch, batch.predicted_s)
    return batch


def run_late(scheduler: Scheduler, clock: VirtualClock, num_batches: int) -> None:
    """Run batches for their predicted time, each starting as long again after the last ended
    (a device that waits on its host between batches): work drains at half speed."""
    for _ in range(num_batches):
        batch = run(scheduler, clock)
        assert batch is not None
        clock.advance(batch.predicted_s)

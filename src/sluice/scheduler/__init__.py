"""Pure scheduling policy: per-model queues, batch formation, deadlines, work-bounded admission.

Nothing here does I/O or reads the wall clock; the worker drives it with a `Clock`, tests with
a `VirtualClock`.
"""

from sluice.scheduler.batcher import Admitted, Batch, Decision, Rejected, RejectReason, Scheduler, WorkItem
from sluice.scheduler.profile import LatencyProfile

__all__ = ["Admitted", "Batch", "Decision", "LatencyProfile", "RejectReason", "Rejected", "Scheduler", "WorkItem"]

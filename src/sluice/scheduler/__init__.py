"""Pure scheduling policy: per-model queues, batch formation, deadlines, work-bounded admission.

Nothing here does I/O or reads the wall clock; the worker drives it with a `Clock`, tests with
a `VirtualClock`.
"""

from sluice.scheduler.batcher import Admitted, Batch, Decision, Rejected, RejectReason, Scheduler, WorkItem
from sluice.scheduler.fair import TenantStats
from sluice.scheduler.profile import LatencyProfile
from sluice.scheduler.waits import ClassWait, TenantWait, WaitReport

__all__ = ["Admitted", "Batch", "ClassWait", "Decision", "LatencyProfile", "RejectReason", "Rejected", "Scheduler",
           "TenantStats", "TenantWait", "WaitReport", "WorkItem"]

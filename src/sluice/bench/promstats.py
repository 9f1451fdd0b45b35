"""What the server says about a run, from two scrapes of its Prometheus `/metrics`.

The load generator scrapes once when measurement starts and once after the last measured
request has finished; the difference gives the server's view of the run:

    mean batch size = Δ sluice_batch_size_sum / Δ sluice_batch_size_count   (summed over label sets)
    busy ratio      = Δ Σ_workers sluice_device_busy_seconds_total / (wall seconds * number of workers)

where the number of workers is the number of distinct `worker` labels on the busy counter, and

    device share of tenant t = Δ sluice_tenant_device_seconds_total{tenant=t} / Σ_tenants of the same

(summed over classes).
Parsing is pure (`parse_snapshot`, `server_delta`); only `scrape` does I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import aiohttp

from sluice.exposition import Scrape

_BATCH_SIZE = "sluice_batch_size"
_DEVICE_BUSY = "sluice_device_busy_seconds"
_TENANT_DEVICE = "sluice_tenant_device_seconds"


@dataclass(frozen=True, slots=True)
class ServerSnapshot:
    """Counter values at one instant (`taken_at_s` on the `time.perf_counter()` clock)."""

    taken_at_s: float
    batch_size_sum: float
    batch_size_count: float
    busy_s_by_worker: dict[str, float] = field(default_factory=dict)
    device_s_by_tenant: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ServerStats:
    """The server's view of one measured window; `None` where the window had nothing to divide by."""

    wall_s: float
    num_batches: float
    mean_batch_size: float | None
    num_workers: int
    busy_ratio: float | None
    device_s_by_tenant: dict[str, float] = field(default_factory=dict)
    """Device seconds each tenant's requests used in the window (all classes)."""

    def device_shares(self) -> dict[str, float]:
        """Each tenant's fraction of the device time that tenants used in the window."""
        total = sum(self.device_s_by_tenant.values())
        return {t: s / total for t, s in self.device_s_by_tenant.items()} if total > 0 else {}


def parse_snapshot(text: str, taken_at_s: float, model: str | None = None) -> ServerSnapshot:
    """Sum the counters this module needs out of a text exposition.

    With `model`, batch sizes count only series labelled with that model. The busy counter has
    no model label (a device is shared by the models on its worker), so it is never filtered.
    """
    scrape = Scrape.parse(text, taken_at_s)
    only = {} if model is None else {"model": model}
    return ServerSnapshot(
        taken_at_s,
        scrape.grouped(_BATCH_SIZE + "_sum", (), **only).get((), 0.0),
        scrape.grouped(_BATCH_SIZE + "_count", (), **only).get((), 0.0),
        {worker: s for (worker,), s in scrape.grouped(_DEVICE_BUSY + "_total", ("worker",)).items()},
        {tenant: s for (tenant,), s in scrape.grouped(_TENANT_DEVICE + "_total", ("tenant",)).items()},
    )


def server_delta(before: ServerSnapshot, after: ServerSnapshot) -> ServerStats:
    wall_s = after.taken_at_s - before.taken_at_s
    if wall_s <= 0:
        raise ValueError(f"the second snapshot must be later than the first (wall {wall_s:.6f} s)")
    num_batches = after.batch_size_count - before.batch_size_count
    items = after.batch_size_sum - before.batch_size_sum
    mean_batch_size = items / num_batches if num_batches > 0 else None
    workers = set(before.busy_s_by_worker) | set(after.busy_s_by_worker)
    # A worker that appears only afterwards (a restart under a new id) started from zero.
    busy_s = sum(after.busy_s_by_worker.get(w, 0.0) - before.busy_s_by_worker.get(w, 0.0) for w in workers)
    busy_ratio = busy_s / (wall_s * len(workers)) if workers else None
    tenants = {t: after.device_s_by_tenant[t] - before.device_s_by_tenant.get(t, 0.0)
               for t in after.device_s_by_tenant}
    return ServerStats(wall_s, num_batches, mean_batch_size, len(workers), busy_ratio, tenants)


async def scrape(session: aiohttp.ClientSession, base_url: str, model: str | None = None,
                 timeout_s: float = 10.0, headers: dict[str, str] | None = None) -> ServerSnapshot | None:
    """One snapshot of the server's counters, or `None` when `/metrics` cannot be read.

    A missing or broken `/metrics` is expected (not every server is sluice), so it is a value.
    The snapshot is stamped at the midpoint of the request.
    """
    started = time.perf_counter()
    try:
        async with session.get(base_url.rstrip("/") + "/metrics", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                return None
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    taken_at_s = (started + time.perf_counter()) / 2
    try:
        return parse_snapshot(text, taken_at_s, model)
    except ValueError:
        return None

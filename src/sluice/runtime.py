"""Process-level tuning shared by the gateway and worker processes."""

from __future__ import annotations

import gc


def settle_garbage_collector() -> None:
    """Call once a process has loaded everything it keeps for its lifetime.

    Full collections walk every live object; in a server that holds large, long-lived module
    graphs (torch, numpy, prometheus, the web framework) they stall the event loop for tens of
    milliseconds, which shows up directly in tail latency. Freezing what exists after start-up
    takes it out of future collections, and a larger first-generation threshold makes young
    collections rarer. Reference counting still frees almost everything at once; the collector
    only has to find cycles.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)

"""Runners: what executes a batch on a device. Only worker-side code imports this package.

    load_runner(version, device) -> Runner
"""

from sluice.engines.base import ItemFailure, PreparedItem, Runner, is_generative, load_runner

__all__ = ["ItemFailure", "PreparedItem", "Runner", "is_generative", "load_runner"]

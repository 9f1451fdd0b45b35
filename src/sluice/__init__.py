"""sluice: an inference serving platform.

Requests arrive one at a time over HTTP (OpenAI-compatible and KServe v2), are admitted at the
gateway, routed to a worker process, batched there by a deadline-aware scheduler and executed on
the worker's device.
"""

from sluice.errors import SluiceError

__version__ = "0.1.0"

__all__ = ["SluiceError", "__version__"]

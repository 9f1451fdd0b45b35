"""The gateway: admits requests, picks a worker, and waits for the answer.

    Gateway.infer() ─▶ Admission.admit() ─▶ Dispatcher.dispatch() ─▶ router.choose()
                    ─▶ WorkerConnection.submit() ──transport──▶ worker
"""

from sluice.gateway.admission import Caller
from sluice.gateway.config import GatewayConfig
from sluice.gateway.gateway import Gateway
from sluice.gateway.ticket import InferResult

__all__ = ["Caller", "Gateway", "GatewayConfig", "InferResult"]

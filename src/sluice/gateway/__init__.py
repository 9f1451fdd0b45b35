"""The gateway: admits requests, picks a worker, and waits for the answer.

    Gateway.infer() ─▶ router.choose() ─▶ WorkerConnection.submit() ──ZeroMQ──▶ worker
"""

from sluice.gateway.gateway import Gateway, GatewayConfig, InferResult

__all__ = ["Gateway", "GatewayConfig", "InferResult"]

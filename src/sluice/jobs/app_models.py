"""What the serving app says of its models, asked in-process (`asgi_call`) as a batch's tenant.

    GET /v1/models          the models listed for the tenant (up, or loaded on demand)
    GET /v1/models/{model}  one model: 200 up, 503 not up yet (loading, its worker being
                            restarted, no worker yet), 404/403 not there for this tenant
    GET /v2/health/ready    the server: 503 while its models load after a restart, a drain

Validation asks which names a file may use (`ModelDirectory`): the listed ones and those known
though not up, whose items then wait for them. The executor asks whether an item's 503 is such a
wait (the server not ready, or the item's model not up) rather than a failure, at most once per
`recheck_s` for the server and for each model: every item of a large batch waiting for a model
gets a 503, and asking each time would put as many requests again through the app.
"""

from __future__ import annotations

import time

import msgspec

from sluice.api.common import TENANT_SCOPE_KEY
from sluice.errors import Unavailable
from sluice.jobs.asgi_call import AppResponse, AsgiApp, call

KNOWN_STATUSES = frozenset({200, 503})
"""`GET /v1/models/{model}` answers of a model the tenant may use: up, or not up yet."""
MAX_REMEMBERED = 1024
"""Models whose state is remembered at most: past it, the expired ones are forgotten."""


class _Model(msgspec.Struct):
    id: str


class _ModelList(msgspec.Struct):
    data: list[_Model]


_decode_models = msgspec.json.Decoder(_ModelList).decode


class AppModels:
    """The app's models, for validation (`listed`, `is_known`) and the executor (`is_waiting`)."""

    def __init__(self, recheck_s: float) -> None:
        self._app: AsgiApp | None = None
        self._recheck_s = recheck_s
        self._server: tuple[float, bool] = (float("-inf"), True)
        """(monotonic time until which it holds, whether the server was ready when last asked)."""
        self._models: dict[tuple[str, str], tuple[float, int]] = {}
        """(owner, model) -> (monotonic time until which it holds, its `GET /v1/models/{model}` status)."""

    def start(self, app: AsgiApp) -> None:
        self._app = app

    async def listed(self, owner: str) -> frozenset[str]:
        answer = await self._get("/v1/models", owner)
        try:
            if answer.status_code == 200:
                return frozenset(model.id for model in _decode_models(answer.body).data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        raise Unavailable(f"the server's model list could not be read (HTTP {answer.status_code})")

    async def is_known(self, owner: str, model: str) -> bool:
        return await self._model_status(owner, model) in KNOWN_STATUSES

    async def is_waiting(self, owner: str, model: str) -> bool:
        """Whether an item of `owner` for `model` answered 503 waits for the server or its model
        to come up (attempts untouched), rather than failed."""
        until, is_ready = self._server
        if time.monotonic() >= until:
            is_ready = (await self._get("/v2/health/ready", owner)).status_code == 200
            self._server = (time.monotonic() + self._recheck_s, is_ready)
        return not is_ready or await self._model_status(owner, model) == 503

    async def _model_status(self, owner: str, model: str) -> int:
        if not model or "?" in model or "#" in model:  # not a name a url can carry: the server has no such model
            return 404
        now = time.monotonic()
        until, status = self._models.get((owner, model), (now, 0))
        if now >= until:
            status = (await self._get(f"/v1/models/{model}", owner)).status_code
            if len(self._models) >= MAX_REMEMBERED:
                self._models = {key: held for key, held in self._models.items() if held[0] > now}
            self._models[(owner, model)] = (time.monotonic() + self._recheck_s, status)
        return status

    async def _get(self, path: str, owner: str) -> AppResponse:
        assert self._app is not None, "asked before start()"
        return await call(self._app, "GET", path, b"", [], {TENANT_SCOPE_KEY: owner})

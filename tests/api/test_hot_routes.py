"""The inference routes skip Starlette's router and middlewares: they must answer exactly as if
they had not (errors by the same table, path parameters, other methods and routes untouched)."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from sluice.api.app import HotRoutes
from sluice.errors import InvalidInput, Overloaded


async def _infer(request: Request) -> Response:
    name = request.path_params["name"]
    if name == "invalid":
        raise InvalidInput("bad tensor", param="inputs")
    if name == "busy":
        raise Overloaded("queue full", retry_after_s=0.25)
    if name == "bug":
        raise RuntimeError("a bug")
    return JSONResponse({"model": name, "body": (await request.body()).decode()})


async def _metadata(request: Request) -> Response:
    return JSONResponse({"metadata": request.path_params["name"]})


def _client() -> TestClient:
    infer = Route("/v2/models/{name}/infer", _infer, methods=["POST"])
    app = Starlette(routes=[infer, Route("/v2/models/{name}", _metadata)])
    return TestClient(HotRoutes(app, [infer]), raise_server_exceptions=False)


def test_a_hot_route_answers_with_its_path_parameters() -> None:
    response = _client().post("/v2/models/m1/infer", content=b"{}")
    assert response.status_code == 200
    assert response.json() == {"model": "m1", "body": "{}"}


def test_errors_take_the_protocols_shape_and_status() -> None:
    client = _client()
    invalid = client.post("/v2/models/invalid/infer", content=b"{}")
    assert (invalid.status_code, invalid.json()) == (400, {"error": "bad tensor"})
    busy = client.post("/v2/models/busy/infer", content=b"{}")
    assert busy.status_code == 503
    assert busy.headers["retry-after"] == "1" and busy.headers["retry-after-ms"] == "250"
    bug = client.post("/v2/models/bug/infer", content=b"{}")
    assert bug.status_code == 500
    assert "a bug" not in bug.text  # a bug's details stay in the log


def test_other_methods_and_routes_still_go_through_starlette() -> None:
    client = _client()
    assert client.get("/v2/models/m1/infer").status_code == 405
    assert client.get("/v2/models/m1").json() == {"metadata": "m1"}
    assert client.post("/v2/elsewhere").status_code == 404

"""Versions through a real server: a declared traffic split with sticky callers, pinned versions in
both protocols, an operator's split, and canaries that roll back or promote on their own."""

from __future__ import annotations

import itertools
import json
import shutil
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from click.testing import CliRunner

from sluice.cli import main
from tests.conftest import ServerProcess, metric_total, write_two_versions

pytestmark = pytest.mark.slow

_values = itertools.count(1)


def _infer(client: httpx.Client, server: ServerProcess, path: str = "/v2/models/emulated/infer",
           **headers: str) -> httpx.Response:
    value = float(next(_values))  # a new input each time: no answer comes from the result cache
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2], "data": [value, 1.0]}]}
    return client.post(f"{server.url}{path}", json=body, headers=headers)


def _admin(client: httpx.Client, server: ServerProcess, method: str, path: str, **body: object) -> httpx.Response:
    return client.request(method, f"{server.url}/admin/models/emulated{path}", json=body or None)


def test_a_declared_split_keeps_each_caller_on_its_version_and_pinned_requests_on_theirs(
        make_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    server = make_server(write_two_versions(tmp_path / "repo", routing="traffic = { 1 = 50, 2 = 50 }"))
    with httpx.Client(timeout=30) as client:
        by_key = {}
        for key in (f"user-{i}" for i in range(40)):
            seen = {_infer(client, server, **{"x-sluice-route-key": key}).json()["model_version"] for _ in range(3)}
            assert len(seen) == 1  # sticky: the same version every time
            by_key[key] = seen.pop()
        assert 8 <= Counter(by_key.values())["2"] <= 32  # about half the callers on each
        pinned = {_infer(client, server, "/v2/models/emulated/versions/1/infer").json()["model_version"]
                  for _ in range(10)}
        assert pinned == {"1"}
        routing = _admin(client, server, "GET", "").json()
        assert routing["split_source"] == "model.toml" and routing["sticky"] is True
        assert [(v["version"], v["traffic_percent"]) for v in routing["versions"]] == [("1", 50.0), ("2", 50.0)]

    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    answer = sdk.embeddings.with_raw_response.create(model="emulated:1", input=["pinned by name"])
    assert answer.headers["x-sluice-model-version"] == "1" and answer.parse().model == "emulated"
    versions = {sdk.embeddings.with_raw_response.create(model="emulated", input=[f"text {i}"], user=user)
                .headers["x-sluice-model-version"] for i, user in enumerate(["alice"] * 5)}
    assert len(versions) == 1  # the `user` field keeps a caller on one version
    with pytest.raises(openai.NotFoundError, match="has no version '7'"):
        sdk.embeddings.create(model="emulated:7", input=["no such version"])
    assert sdk.models.retrieve("emulated:1").id == "emulated:1"  # the name requests use is one to look up
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("emulated:7")


def test_an_operator_split_moves_traffic_and_rollback_undoes_it(make_server: Callable[..., ServerProcess],
                                                               tmp_path: Path) -> None:
    server = make_server(write_two_versions(tmp_path / "repo"))
    with httpx.Client(timeout=30) as client:
        assert {_infer(client, server).json()["model_version"] for _ in range(10)} == {"2"}  # newest by default
        assert _admin(client, server, "GET", "").json()["split_source"] == "newest version"
        moved = _admin(client, server, "PUT", "/traffic", traffic={"1": 100})
        assert moved.status_code == 200 and moved.json()["split_source"] == "operator"
        assert {_infer(client, server).json()["model_version"] for _ in range(10)} == {"1"}
        assert metric_total(server, "sluice_traffic_share", model="emulated", version="1") == 1.0
        assert _admin(client, server, "POST", "/rollback").status_code == 200
        assert {_infer(client, server).json()["model_version"] for _ in range(10)} == {"2"}
        # mistakes are the caller's, in the error envelope
        refused = _admin(client, server, "PUT", "/traffic", traffic={"9": 100})
        assert refused.status_code == 400 and "no version '9'" in refused.json()["error"]["message"]
        assert _admin(client, server, "PUT", "/traffic", traffic={"1": -1}).status_code == 400
        twice = client.put(f"{server.url}/admin/models/emulated/traffic", content=b'{"traffic": {"1": 50, "1": 50}}',
                           headers={"content-type": "application/json"})  # valid JSON: the last would win
        assert twice.status_code == 400 and twice.json()["error"]["param"] == "traffic"
        assert "names version '1' more than once" in twice.json()["error"]["message"]
        assert _admin(client, server, "POST", "/promote").status_code == 409  # no canary running
        assert client.get(f"{server.url}/admin/models/nope").status_code == 404

    # the same through the command line
    runner = CliRunner()
    moved = runner.invoke(main, ["models", "traffic", "emulated", "1=75", "2=25", "--no-sticky", "--url", server.url])
    assert moved.exit_code == 0, moved.output
    assert "emulated: traffic from operator, drawn per request" in moved.output
    assert "version    1   75.00%  ready" in moved.output
    status = runner.invoke(main, ["models", "status", "--url", server.url, "--json"])
    assert json.loads(status.output)["data"][0]["versions"][1]["traffic_percent"] == 25.0
    twice = runner.invoke(main, ["models", "traffic", "emulated", "1=50", "2=25", "1=25", "--url", server.url])
    assert twice.exit_code == 2 and "version 1 is given more than once" in twice.stderr, twice.output


def test_a_failing_canary_is_rolled_back_on_its_own(make_server: Callable[..., ServerProcess],
                                                   tmp_path: Path) -> None:
    server = make_server(write_two_versions(tmp_path / "repo", routing="traffic = { 1 = 100 }",
                                       v2_params="error_rate = 1.0"))
    with httpx.Client(timeout=30) as client:
        started = _admin(client, server, "POST", "/canary", version="2", steps=[20], step_seconds=60,
                         min_requests=15)
        assert started.status_code == 201 and started.json()["canary"]["baseline"] == "1"
        assert _admin(client, server, "POST", "/canary", version="2").status_code == 409  # one at a time
        statuses = Counter((r.status_code, r.json().get("model_version")) for r in
                           (_infer(client, server) for _ in range(300)))
        # the canary's requests failed (503, a device fault) until it had min_requests of them,
        # judged at the last of those: one at a time, exactly 15 failed
        assert statuses == {(503, None): 15, (200, "1"): 285}
        routing = _admin(client, server, "GET", "").json()
        assert routing["canary"]["status"] == "rolled_back" and "failed" in routing["canary"]["reason"]
        assert routing["split_source"] == "canary result"
        assert [v["traffic_percent"] for v in routing["versions"]] == [100.0, 0.0]
        assert {_infer(client, server).status_code for _ in range(20)} == {200}
    assert metric_total(server, "sluice_canary_events_total", model="emulated", event="rolled_back") == 1
    assert "canary of model emulated: rolled back" in server.log()


def test_a_healthy_canary_is_promoted_step_by_step(make_server: Callable[..., ServerProcess],
                                                  tmp_path: Path) -> None:
    server = make_server(write_two_versions(tmp_path / "repo", routing="traffic = { 1 = 100 }"))
    with httpx.Client(timeout=30) as client:
        assert _admin(client, server, "POST", "/canary", version="2", steps=[20, 50], step_seconds=0.2,
                      min_requests=10, max_latency_ratio=5).status_code == 201
        for _ in range(400):
            assert _infer(client, server).status_code == 200
            if _admin(client, server, "GET", "").json()["canary"]["status"] != "running":
                break
        routing = _admin(client, server, "GET", "").json()
        assert routing["canary"]["status"] == "promoted", routing
        assert {_infer(client, server).json()["model_version"] for _ in range(10)} == {"2"}
        assert _admin(client, server, "POST", "/rollback").status_code == 200  # undo the promotion
        assert {_infer(client, server).json()["model_version"] for _ in range(10)} == {"1"}
    assert metric_total(server, "sluice_canary_events_total", model="emulated", event="advanced") == 1
    assert metric_total(server, "sluice_canary_events_total", model="emulated", event="promoted") == 1


def test_an_answer_that_failed_on_a_version_names_that_version(make_server: Callable[..., ServerProcess],
                                                                tmp_path: Path) -> None:
    server = make_server(write_two_versions(tmp_path / "repo", routing="traffic = { 1 = 50, 2 = 50 }",
                                       v2_params="error_rate = 1.0"))
    with httpx.Client(timeout=30) as client:
        answers = [_infer(client, server) for _ in range(40)]
    failed = [a for a in answers if a.status_code != 200]
    assert failed and all(a.status_code == 503 and a.headers["x-sluice-model-version"] == "2" for a in failed)
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as raised:
        sdk.embeddings.create(model="emulated:2", input=["fails on version 2"])
    assert raised.value.response.headers["x-sluice-model-version"] == "2"
    missing = httpx.post(f"{server.url}/v2/models/emulated/versions/9/infer", json={})
    assert missing.status_code == 404 and "x-sluice-model-version" not in missing.headers  # routed nowhere


def test_a_request_refused_before_dispatch_still_names_its_version(make_server: Callable[..., ServerProcess],
                                                                   tmp_path: Path) -> None:
    """An overload refusal (503) comes before the request is sent to a worker, after its version
    was chosen: it says which one, as answers and later failures do."""
    server = make_server(write_two_versions(tmp_path / "repo", routing="traffic = { 1 = 100 }", max_batch_size=1,
                                            alpha_ms=50))
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with httpx.Client(timeout=30) as client, ThreadPoolExecutor(16) as pool:
        queued = [pool.submit(_infer, client, server) for _ in range(16)]  # 800 ms of work, one at a time
        time.sleep(0.2)
        with pytest.raises(openai.APIStatusError) as raised:
            sdk.embeddings.create(model="emulated", input=["late"], extra_headers={"x-request-timeout-ms": "80"})
        refused = [_infer(client, server, **{"x-request-timeout-ms": "80"}) for _ in range(3)]
        assert all(f.result().status_code == 200 for f in queued)
    overloaded = [r for r in refused if r.status_code == 503]
    assert overloaded and all("miss its deadline" in r.json()["error"] for r in overloaded), refused
    assert all(r.headers["x-sluice-model-version"] == "1" for r in refused)
    assert raised.value.status_code == 503 and raised.value.response.headers["x-sluice-model-version"] == "1"


def test_status_says_so_when_no_model_is_served(make_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    server = make_server(write_two_versions(tmp_path / "repo"))
    runner = CliRunner()
    assert runner.invoke(main, ["models", "unload", "emulated", "--url", server.url]).exit_code == 0
    status = runner.invoke(main, ["models", "status", "--url", server.url])
    assert status.exit_code == 0 and status.stdout.startswith("no models are served"), status.output
    as_json = runner.invoke(main, ["models", "status", "--url", server.url, "--json"])
    assert as_json.exit_code == 0 and json.loads(as_json.stdout)["data"] == []
    one = runner.invoke(main, ["models", "status", "emulated", "--url", server.url])
    assert one.exit_code == 1 and "404: model 'emulated' is not served" in one.stderr


def test_a_canary_takes_its_callers_from_its_baseline_only(make_server: Callable[..., ServerProcess],
                                                           tmp_path: Path) -> None:
    """An A/B test of versions 1 and 2, then a canary of 3 against 1: 2 keeps its half of the
    traffic and every one of its callers; the canary's callers were all 1's."""
    repo = write_two_versions(tmp_path / "repo")
    (repo / "emulated" / "3").mkdir()
    (repo / "emulated" / "3" / "SHA256SUMS").write_text("")
    server = make_server(repo)
    keys = [f"user-{i}" for i in range(80)]
    with httpx.Client(timeout=30) as client:
        def callers() -> dict[str, set[str]]:
            by_version: dict[str, set[str]] = {}
            for key in keys:
                version = _infer(client, server, **{"x-sluice-route-key": key}).json()["model_version"]
                by_version.setdefault(version, set()).add(key)
            return by_version

        assert _admin(client, server, "PUT", "/traffic", traffic={"1": 50, "2": 50}).status_code == 200
        before = callers()
        started = _admin(client, server, "POST", "/canary", version="3", baseline="1", steps=[30],
                         step_seconds=600, min_requests=10_000)
        assert started.status_code == 201, started.text
        assert [(v["version"], v["traffic_percent"]) for v in started.json()["versions"]] == \
            [("1", 35.0), ("2", 50.0), ("3", 15.0)]
        during = callers()
        assert during["2"] == before["2"]
        assert during["3"] and during["3"] <= before["1"]
        assert _admin(client, server, "POST", "/promote").status_code == 200
        after = callers()
        assert after["2"] == before["2"] and after["3"] == before["1"]


def test_a_canary_against_a_version_without_traffic_is_refused(make_server: Callable[..., ServerProcess],
                                                               tmp_path: Path) -> None:
    """Versions 1 and 2, all traffic to the newest (2): a canary of 2 against 1 would have nothing
    to take, and would have sent 1 most of the traffic. It is refused, naming 1, until 1 has some."""
    server = make_server(write_two_versions(tmp_path / "repo"))
    with httpx.Client(timeout=30) as client:
        for body in ({"version": "2", "baseline": "1"}, {"version": "2"}):
            refused = _admin(client, server, "POST", "/canary", **body)
            assert refused.status_code == 409 and refused.json()["error"]["param"] == "baseline", refused.text
            assert "version 1 has no traffic" in refused.json()["error"]["message"] or \
                "give version 1 traffic first" in refused.json()["error"]["message"]
            assert "sluice models traffic emulated 1=100" in refused.json()["error"]["message"]
        routing = _admin(client, server, "GET", "").json()
        assert routing["canary"] is None and routing["split_source"] == "newest version"
        assert {_infer(client, server).json()["model_version"] for _ in range(10)} == {"2"}

    runner = CliRunner()
    refused = runner.invoke(main, ["models", "canary", "emulated", "2", "--baseline", "1", "--url", server.url])
    assert refused.exit_code == 1 and "409: " in refused.stderr and "version 1 has no traffic" in refused.stderr
    assert runner.invoke(main, ["models", "traffic", "emulated", "1=100", "--url", server.url]).exit_code == 0
    started = runner.invoke(main, ["models", "canary", "emulated", "2", "--url", server.url])
    assert started.exit_code == 0 and "canary: version 2 against 1, running at 5%" in started.stdout, started.output


def test_a_refused_canary_says_what_was_asked_why_not_and_what_to_do(make_server: Callable[..., ServerProcess],
                                                                     tmp_path: Path) -> None:
    server = make_server(write_two_versions(tmp_path / "repo", routing="traffic = { 1 = 100 }"))
    asked = "cannot start a canary of model 'emulated' version '2'"
    refusals = [  # (body, status, param, what the message says)
        ({"version": "9"}, 400, "version",
         ["cannot start a canary of model 'emulated' version '9'", "version 9, is not served by any worker",
          "serves 1, 2", "load it first (`sluice models load emulated`"]),
        ({"version": "2", "baseline": "7"}, 400, "baseline",
         [asked, "its baseline, version 7, is not served by any worker", "sluice models load emulated"]),
        ({"version": "2", "baseline": "2"}, 400, "baseline", [f"{asked} against itself", "give another `baseline`"]),
        ({"version": "2", "steps": [50, 5]}, 400, None, [asked, "steps must be increasing percentages"]),
    ]
    with httpx.Client(timeout=30) as client:
        for body, status, param, says in refusals:
            refused = _admin(client, server, "POST", "/canary", **body)
            error = refused.json()["error"]
            assert (refused.status_code, error["param"], error["type"]) == (status, param, "invalid_request_error")
            assert all(part in error["message"] for part in says), error["message"]
        for action in ("promote", "rollback"):  # nothing to act on
            refused = _admin(client, server, "POST", f"/{action}")
            assert refused.status_code == 409
            assert refused.json()["error"]["message"].startswith(f"cannot {action} model 'emulated': it has no canary")
        assert "sluice models canary emulated VERSION" in _admin(client, server, "POST", "/promote").json()["error"][
            "message"]
        assert _admin(client, server, "POST", "/canary", version="2", step_seconds=600).status_code == 201
        again = _admin(client, server, "POST", "/canary", version="2")
        assert again.status_code == 409 and again.json()["error"]["message"] == (
            f"{asked}: a canary of version 2 is already running; one runs at a time: let it finish, or end it first "
            "(`sluice models promote emulated` or `sluice models rollback emulated`)")

    runner = CliRunner()  # the same refusals on the command line: exit 1, the server's message on stderr
    for args, says in ((["canary", "emulated", "2"], f"409: {asked}: a canary of version 2 is already running"),
                       (["rollback", "emulated"], None),
                       (["canary", "emulated", "9"], "400: cannot start a canary of model 'emulated' version '9': "
                                                     "the canary's version, version 9, is not served by any worker"),
                       (["canary", "emulated", "2", "--baseline", "2"], f"400: {asked} against itself"),
                       (["promote", "emulated"], "409: cannot promote model 'emulated': it has no canary running")):
        answer = runner.invoke(main, ["models", *args, "--url", server.url])
        if says is None:
            assert answer.exit_code == 0, answer.output
        else:
            assert answer.exit_code == 1 and says in answer.stderr and not answer.stdout, answer.output


def test_a_split_none_of_whose_versions_is_served_refuses_unversioned_requests(
        make_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    """A split that names only versions no worker serves (here: version 1, taken out of the
    repository) is answered 503 `model_version_unavailable`, saying how to mend it, rather than
    sent to a version the split does not name. Requests that name a version are served."""
    repo = write_two_versions(tmp_path / "repo", routing="traffic = { 1 = 100 }")
    server = make_server(repo)
    runner = CliRunner()
    assert runner.invoke(main, ["models", "traffic", "emulated", "1=100", "--url", server.url]).exit_code == 0
    shutil.rmtree(repo / "emulated" / "1")
    loaded = runner.invoke(main, ["models", "load", "emulated", "--url", server.url])
    assert loaded.exit_code == 0 and "serving version 2" in loaded.stdout, loaded.output
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")  # it would retry a 503 without being told
    with httpx.Client(timeout=30) as client:
        refused = _infer(client, server)
        assert refused.status_code == 503 and "x-sluice-model-version" not in refused.headers
        message = refused.json()["error"]
        assert message.startswith("model 'emulated' serves none of the versions its traffic split names (the split "
                                  "set by an operator: version 1; it serves 2)"), message
        assert "sluice models traffic emulated 2=100" in message and "sluice models traffic emulated --reset" in message
        with pytest.raises(openai.APIStatusError) as raised:
            sdk.embeddings.create(model="emulated", input=["no version named"])
        assert raised.value.status_code == 503 and raised.value.code == "model_version_unavailable"
        assert raised.value.response.headers["x-should-retry"] == "false"
        assert _infer(client, server, "/v2/models/emulated/versions/2/infer").status_code == 200
        assert sdk.embeddings.create(model="emulated:2", input=["version named"]).model == "emulated"
        routing = _admin(client, server, "GET", "").json()
        assert [(v["version"], v["traffic_percent"]) for v in routing["versions"]] == [("2", 0.0)]
        assert metric_total(server, "sluice_traffic_share", model="emulated", version="2") == 0.0
        status = runner.invoke(main, ["models", "status", "emulated", "--url", server.url])
        assert "none of the versions its split names is served" in status.stdout

        # back to model.toml's split: it names version 1 too
        assert runner.invoke(main, ["models", "traffic", "emulated", "--reset", "--url", server.url]).exit_code == 0
        declared = _infer(client, server)
        assert declared.status_code == 503 and "declared in its model.toml [routing]" in declared.json()["error"]
        assert runner.invoke(main, ["models", "traffic", "emulated", "2=100", "--url", server.url]).exit_code == 0
        assert _infer(client, server).json()["model_version"] == "2"

"""Loading and unloading models while serving (Triton's explicit model control over the
repository): a real server, real clients (`sluice models load`, `tritonclient`, `openai`), and
requests flowing all along."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.conftest import ServerProcess, eventually, start_server, write_emulated_model, write_tiny_lm_model
from tests.user_models import add_gated_version

pytestmark = pytest.mark.slow

ROW = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}


def _add_version(repo: Path, version: str, manifest: str = "") -> None:
    folder = repo / "emulated" / version
    folder.mkdir()
    (folder / "SHA256SUMS").write_text(manifest)


def _versions(server: ServerProcess) -> list[str]:
    return httpx.get(f"{server.url}/v2/models/emulated").json()["versions"]


def _load(server: ServerProcess, name: str, action: str = "load", **kwargs: object) -> httpx.Response:
    return httpx.post(f"{server.url}/v2/repository/models/{name}/{action}", timeout=120, **kwargs)  # type: ignore[arg-type]


class _Traffic:
    """Requests to `path` back to back on two threads until stopped; the statuses they got."""

    def __init__(self, url: str, path: str) -> None:
        self.statuses: Counter[int] = Counter()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._send, args=(url, path)) for _ in range(2)]
        for thread in self._threads:
            thread.start()

    def _send(self, url: str, path: str) -> None:
        with httpx.Client(base_url=url, timeout=30, headers={"cache-control": "no-cache"}) as client:
            while not self._stop.is_set():
                self.statuses[client.post(path, json=ROW).status_code] += 1

    def stop(self) -> Counter[int]:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        return self.statuses


@pytest.fixture
def served(make_server, tmp_path) -> Iterator[tuple[ServerProcess, Path]]:
    repo = write_emulated_model(tmp_path / "models", alpha_ms=2.0, beta_ms=0.1)
    yield make_server(repo), repo


def test_versions_added_and_removed_are_loaded_and_unloaded_while_requests_flow(served):
    server, repo = served
    traffic = _Traffic(server.url, "/v2/models/emulated/infer")
    time.sleep(0.5)
    _add_version(repo, "2")
    loaded = subprocess.run([sys.executable, "-m", "sluice", "models", "load", "emulated", "--url", server.url],
                            capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "emulated: serving versions 1, 2"
    assert _versions(server) == ["1", "2"]
    answer = httpx.post(f"{server.url}/v2/models/emulated/versions/2/infer", json=ROW)
    assert answer.status_code == 200 and answer.json()["outputs"][0]["data"] == [10.0]

    shutil.rmtree(repo / "emulated" / "1")  # unversioned requests go to version 2 from now on
    assert _load(server, "emulated").json() == {"name": "emulated", "versions": ["2"]}
    time.sleep(0.5)
    statuses = traffic.stop()
    assert statuses[200] > 50 and set(statuses) == {200}  # not one request lost to the changes
    assert _versions(server) == ["2"]
    gone = httpx.post(f"{server.url}/v2/models/emulated/versions/1/infer", json=ROW)
    assert gone.status_code == 404 and "has no version '1'" in gone.json()["error"]
    eventually(lambda: "unloaded emulated v1" in server.log(), "version 1 freed")


def test_a_version_changed_in_place_and_loaded_right_after_its_unload_serves_its_new_settings(served):
    server, repo = served
    embed = {"model": "emulated", "input": "hello"}
    assert len(httpx.post(f"{server.url}/v1/embeddings", json=embed).json()["data"][0]["embedding"]) == 16
    write_emulated_model(repo, alpha_ms=2.0, beta_ms=0.1, dims=8)  # version 1's settings change in place
    assert _load(server, "emulated", "unload").status_code == 200
    assert _load(server, "emulated").json() == {"name": "emulated", "versions": ["1"]}  # at once, not yet freed
    answer = httpx.post(f"{server.url}/v1/embeddings", json=embed, headers={"cache-control": "no-store"})
    assert answer.status_code == 200 and len(answer.json()["data"][0]["embedding"]) == 8  # not the old load's 16


def test_a_version_that_fails_its_checks_is_refused_alone(served):
    server, repo = served
    _add_version(repo, "3", manifest="0" * 64 + "  weights.bin\n")
    refused = _load(server, "emulated")
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert "version 3" in error and "weights.bin" in error and "served now: version 1" in error
    assert _versions(server) == ["1"]
    assert httpx.post(f"{server.url}/v2/models/emulated/infer", json=ROW).status_code == 200
    index = httpx.post(f"{server.url}/v2/repository/index").json()
    assert {(e["name"], e["version"], e["state"]) for e in index} >= {("emulated", "3", "UNAVAILABLE"),
                                                                     ("emulated", "1", "READY")}


def test_tritonclient_unloads_and_loads_and_a_restarted_worker_keeps_a_model_unloaded(served):
    server, _ = served
    client = triton.InferenceServerClient(url=server.url.removeprefix("http://"))
    try:
        client.unload_model("emulated")
        assert not client.is_model_ready("emulated")
        assert client.is_server_ready()  # nothing to serve, by choice: still reachable to load it again
        assert client.get_model_repository_index() == [
            {"name": "emulated", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}]
        unloaded = httpx.post(f"{server.url}/v2/models/emulated/infer", json=ROW)
        assert unloaded.status_code == 404 and "model 'emulated' is unloaded" in unloaded.json()["error"]
        os.kill(server.worker_pids()[0], signal.SIGKILL)
        eventually(lambda: "sluice_worker_restarts_total 1.0" in (metrics := httpx.get(f"{server.url}/metrics").text)
                   and "sluice_workers_ready 1.0" in metrics, "the worker restarted", timeout_s=60)
        time.sleep(1)  # the restarted worker loaded the whole repository, and was told to unload it again
        assert not client.is_model_ready("emulated")
        client.load_model("emulated")
        assert client.is_model_ready("emulated")
        rows = triton.InferInput("INPUT0", [1, 4], "FP32")
        rows.set_data_from_numpy(np.array([[1, 2, 3, 4]], dtype=np.float32))
        assert client.infer("emulated", [rows]).as_numpy("OUTPUT0").tolist() == [10.0]
        with pytest.raises(InferenceServerException, match="not in the model repository"):
            client.load_model("no-such-model")
        with pytest.raises(InferenceServerException, match="nothing to unload"):
            client.unload_model("no-such-model")
        with pytest.raises(InferenceServerException, match="parameters"):
            client.load_model("emulated", config='{"max_batch_size": 8}')
    finally:
        client.close()


def test_a_generative_model_new_to_the_repository_is_loaded_and_unloaded(served):
    server, repo = served
    write_tiny_lm_model(repo, "tiny")
    assert _load(server, "tiny").json() == {"name": "tiny", "versions": ["1"]}
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    completion = sdk.completions.create(model="tiny", prompt="hello", max_tokens=4)
    assert completion.usage.completion_tokens == 4
    assert _load(server, "tiny", "unload").json() == {"name": "tiny", "versions": []}
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="tiny", prompt="hello", max_tokens=4)
    eventually(lambda: "unloaded tiny v1" in server.log(), "the engine freed")
    assert httpx.post(f"{server.url}/v2/models/emulated/infer", json=ROW).status_code == 200


def test_a_polled_repository_is_followed_without_being_asked(make_server, tmp_path):
    repo = write_emulated_model(tmp_path / "models", alpha_ms=2.0, beta_ms=0.1)
    server = make_server(repo, "--poll-repository", "0.3")
    _add_version(repo, "2")
    eventually(lambda: _versions(server) == ["1", "2"], "version 2 loaded on its own")
    shutil.rmtree(repo / "emulated" / "1")
    eventually(lambda: _versions(server) == ["2"], "version 1 unloaded on its own")
    assert "model emulated changed in the repository: serving version(s) 2" in server.log()
    _load(server, "emulated", "unload")
    _add_version(repo, "3")  # an unloaded model stays unloaded, whatever its folder does
    time.sleep(1.5)
    assert httpx.get(f"{server.url}/v2/models/emulated").status_code == 404


def test_a_model_loaded_on_demand_loads_at_its_first_request_and_goes_when_idle(make_server, tmp_path):
    repo = write_emulated_model(tmp_path / "models", alpha_ms=2.0, beta_ms=0.1)
    write_emulated_model(repo, "lazy", alpha_ms=2.0, beta_ms=0.1)
    toml = repo / "lazy" / "model.toml"
    toml.write_text(toml.read_text() + "[loading]\non_demand = true\nidle_unload_s = 1.5\n")
    server = make_server(repo)  # ready without it

    def lazy_state() -> tuple[str, str]:
        (entry,) = [e for e in httpx.post(f"{server.url}/v2/repository/index").json() if e["name"] == "lazy"]
        return entry["state"], entry["reason"]

    assert lazy_state() == ("UNAVAILABLE", "loaded on demand, by its first inference request")
    assert "lazy" in [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
    assert httpx.get(f"{server.url}/v1/models/lazy").json()["id"] == "lazy"  # as listed, and loads nothing
    assert httpx.get(f"{server.url}/v2/models/lazy/ready").status_code == 503  # a probe loads nothing
    time.sleep(0.5)
    assert lazy_state()[0] == "UNAVAILABLE"

    first = httpx.post(f"{server.url}/v2/models/lazy/infer", json=ROW)
    assert first.status_code == 503 and "being loaded on demand" in first.json()["error"]
    assert 0.25 <= int(first.headers["retry-after-ms"]) / 1000 <= 30 and int(first.headers["retry-after"]) >= 1
    eventually(lambda server=server: httpx.post(f"{server.url}/v2/models/lazy/infer", json=ROW).status_code == 200,
               "the model loaded on demand")
    assert lazy_state() == ("READY", "")

    eventually(lambda: lazy_state()[0] == "UNAVAILABLE", "the model unloaded after 1.5 s without a request")
    assert "taking lazy v1 off after 2 s without a request" in server.log()
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=5)
    assert sdk.embeddings.create(model="lazy", input="hi").data  # the SDK waits out the 503s of the load
    assert httpx.post(f"{server.url}/v2/models/emulated/infer", json=ROW).status_code == 200


def test_within_a_memory_budget_the_least_recently_used_idle_model_makes_room(make_server, tmp_path):
    from sluice.repository import MANIFEST, write_manifest

    repo = tmp_path / "models"
    for name in ("a", "b", "c"):  # 0.9 MiB of "weights" each: two fit in 2 MiB, three do not
        write_emulated_model(repo, name, alpha_ms=2.0, beta_ms=0.1)
        (repo / name / "1" / "w.bin").write_bytes(bytes(900 * 1024))
        write_manifest(repo / name / "1", repo / name / "1" / MANIFEST)
        toml = repo / name / "model.toml"
        toml.write_text(toml.read_text() + "[loading]\non_demand = true\n")
    server = make_server(write_emulated_model(repo, alpha_ms=2.0, beta_ms=0.1), "--model-memory-mb", "2")

    def infer(name: str) -> int:
        return httpx.post(f"{server.url}/v2/models/{name}/infer", json=ROW).status_code

    def states() -> dict[str, str]:
        return {e["name"]: e["state"] for e in httpx.post(f"{server.url}/v2/repository/index").json()}

    for name in ("a", "b", "c"):
        assert infer(name) == 503  # loading on demand
        eventually(lambda name=name: infer(name) == 200, f"{name} loaded")
    assert states() == {"a": "UNAVAILABLE", "b": "READY", "c": "READY", "emulated": "READY"}
    assert "unloading a v1, the least recently used, to make room for c" in server.log()
    eventually(lambda: infer("a") == 200, "a loaded again, in b's place")
    assert states() == {"a": "READY", "b": "UNAVAILABLE", "c": "READY", "emulated": "READY"}


def test_a_load_that_finds_the_model_toml_broken_keeps_the_versions_it_serves(served):
    server, repo = served
    toml = repo / "emulated" / "model.toml"
    good = toml.read_text()
    toml.write_text(good + "kind = \n")  # a typo saved before `sluice models load`
    refused = _load(server, "emulated")
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert "model.toml: not valid TOML" in error and "served now: version 1" in error
    assert _versions(server) == ["1"]  # not taken off as if its folder had gone
    assert httpx.post(f"{server.url}/v2/models/emulated/infer", json=ROW).status_code == 200
    toml.write_text(good)
    _add_version(repo, "2")
    assert _load(server, "emulated").json() == {"name": "emulated", "versions": ["1", "2"]}


def test_a_repository_of_models_loaded_on_demand_or_of_none_is_ready(tmp_path):
    repo = write_emulated_model(tmp_path / "models", "lazy", alpha_ms=2.0, beta_ms=0.1)
    toml = repo / "lazy" / "model.toml"
    toml.write_text(toml.read_text() + "[loading]\non_demand = true\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    for models, line in ((repo, "  on demand: lazy v1 (loaded by its first request)"), (empty, "  no models: ")):
        server = start_server(models, tmp_path, ready_timeout_s=30)  # a readiness probe lets traffic through
        try:
            eventually(lambda server=server: "listening on" in server.log(), "the banner")
            assert line in server.log()
            if models == repo:
                assert httpx.post(f"{server.url}/v2/models/lazy/infer", json=ROW).status_code == 503  # loads it
                lazy = f"{server.url}/v2/models/lazy/infer"
                eventually(lambda lazy=lazy: httpx.post(lazy, json=ROW).status_code == 200, "loaded on demand")
            else:
                write_emulated_model(models, alpha_ms=2.0, beta_ms=0.1)
                assert _load(server, "emulated").json() == {"name": "emulated", "versions": ["1"]}
        finally:
            server.stop()



def test_a_model_loaded_on_demand_that_the_memory_budget_cannot_hold_stays_listed_and_says_why(make_server,
                                                                                                tmp_path):
    from sluice.repository import MANIFEST, write_manifest

    repo = write_emulated_model(tmp_path / "models", "big", alpha_ms=2.0, beta_ms=0.1)
    (repo / "big" / "1" / "w.bin").write_bytes(bytes(2 * 1024 * 1024))  # 2 MiB under a 1 MiB budget
    write_manifest(repo / "big" / "1", repo / "big" / "1" / MANIFEST)
    toml = repo / "big" / "model.toml"
    toml.write_text(toml.read_text() + "[loading]\non_demand = true\n")
    server = make_server(write_emulated_model(repo, alpha_ms=2.0, beta_ms=0.1), "--model-memory-mb", "1")

    def infer() -> httpx.Response:
        return httpx.post(f"{server.url}/v2/models/big/infer", json=ROW)

    assert infer().status_code == 503
    eventually(lambda: "the last try did not load it" in infer().text, "the first try over")
    again = infer()  # still there, to be tried again: not a 404 "does not exist"
    assert again.status_code == 503 and "more than the worker's model memory budget of 1.0 MB" in again.text
    refused = _load(server, "big")  # an admin's load says why too
    assert refused.status_code == 400 and "model memory budget" in refused.json()["error"]
    assert [e["state"] for e in httpx.post(f"{server.url}/v2/repository/index").json() if e["name"] == "big"] \
        == ["UNAVAILABLE"]



def test_a_version_asked_for_while_its_load_runs_is_not_ready_yet_rather_than_missing(served, tmp_path):
    server, repo = served
    model = repo / "gated"

    def add_version(version: str) -> None:
        add_gated_version(model, version, tmp_path / f"gate{version}")

    answers: list[httpx.Response] = []

    def load() -> threading.Thread:
        thread = threading.Thread(target=lambda: answers.append(_load(server, "gated")))
        thread.start()
        return thread

    def status(path: str) -> int:
        return httpx.get(f"{server.url}/v2/models/gated{path}").status_code

    add_version("1")
    loading = load()  # a model new to the repository
    eventually(lambda: status("") == 503, "503 while the model loads")
    assert "model 'gated' is being loaded" in httpx.get(f"{server.url}/v2/models/gated").json()["error"]
    (tmp_path / "gate1").touch()
    loading.join()
    assert answers.pop().json() == {"name": "gated", "versions": ["1"]}

    add_version("2")
    loading = load()  # a version new to a model that serves
    eventually(lambda: status("/versions/2/ready") == 503, "503 while the version loads")
    answer = httpx.post(f"{server.url}/v2/models/gated/versions/2/infer",
                        json={"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}]})
    assert answer.status_code == 503 and "version '2' is not ready" in answer.json()["error"]
    assert answer.headers["retry-after"] == "1"
    assert status("/versions/1/ready") == 200  # the version served goes on
    (tmp_path / "gate2").touch()
    loading.join()
    assert answers.pop().json() == {"name": "gated", "versions": ["1", "2"]}
    assert status("/versions/2/ready") == 200 and status("/versions/3") == 404


def test_the_command_line_prints_why_a_load_or_unload_was_refused(served):
    from click.testing import CliRunner

    from sluice.cli import main

    server, repo = served
    runner = CliRunner()
    _add_version(repo, "3", manifest="0" * 64 + "  weights.bin\n")
    refused = runner.invoke(main, ["models", "load", "emulated", "--url", server.url])
    assert refused.exit_code == 1  # the server's reason, not "400: Bad Request"
    assert "400: model 'emulated' could not be loaded (version 3: " in refused.output
    assert "weights.bin" in refused.output
    missing = runner.invoke(main, ["models", "unload", "no-such-model", "--url", server.url])
    assert missing.exit_code == 1 and "404: model 'no-such-model' is not served: there is nothing to unload" \
        in missing.output
    for args in (["traffic", "emulated", "1=nan"], ["canary", "emulated", "1", "--step-seconds", "inf"]):
        bad = runner.invoke(main, ["models", *args, "--url", server.url])  # not "request body is not valid JSON"
        assert bad.exit_code != 0 and "JSON" not in bad.output, bad.output


def test_a_slow_load_holds_up_no_other_models_load_or_unload(served, tmp_path):
    server, repo = served
    gate = tmp_path / "gate"
    add_gated_version(repo / "gated", "1", gate)
    loading = threading.Thread(target=lambda: _load(server, "gated"))
    loading.start()
    try:
        eventually(lambda: (tmp_path / "gate.started").exists(), "the worker loading the gated model")
        # an operator takes another model off, and back, while that load runs (it used to wait for it)
        unloaded = httpx.post(f"{server.url}/v2/repository/models/emulated/unload", timeout=20)
        assert unloaded.json() == {"name": "emulated", "versions": []}
        loaded = httpx.post(f"{server.url}/v2/repository/models/emulated/load", timeout=20)
        assert loaded.json() == {"name": "emulated", "versions": ["1"]}
        assert not gate.exists() and loading.is_alive()
    finally:
        gate.touch()
        loading.join()
    assert httpx.get(f"{server.url}/v2/models/gated/ready").status_code == 200


def test_a_canary_of_a_version_still_loading_is_refused_until_it_is_ready(served, tmp_path):
    server, repo = served
    (tmp_path / "open").touch()
    toml = add_gated_version(repo / "gated", "1", tmp_path / "open") / "model.toml"
    toml.write_text(toml.read_text() + "\n[routing]\ntraffic = { 1 = 100 }\n")  # version 1 keeps it: a baseline
    assert _load(server, "gated").status_code == 200
    gate = tmp_path / "gate"
    add_gated_version(repo / "gated", "2", gate)
    loading = threading.Thread(target=lambda: _load(server, "gated"))
    loading.start()
    canary = f"{server.url}/admin/models/gated/canary"
    try:
        eventually(lambda: (tmp_path / "gate.started").exists(), "the worker loading version 2")
        refused = httpx.post(canary, json={"version": "2"}, timeout=20)
        error = refused.json()["error"]
        assert (refused.status_code, error["param"]) == (409, "version"), refused.text
        assert "version 2, is not ready yet" in error["message"] and "sluice models status gated" in error["message"]
    finally:
        gate.touch()
        loading.join()
    started = httpx.post(canary, json={"version": "2", "step_seconds": 600}, timeout=20)
    assert started.status_code == 201 and started.json()["canary"]["baseline"] == "1", started.text


def test_the_command_line_waits_for_a_long_load_and_says_so_when_it_gives_up(served, tmp_path, monkeypatch):
    import urllib.request

    from click.testing import CliRunner

    from sluice.cli import main

    server, repo = served
    runner = CliRunner()
    waited: list[float] = []
    urlopen = urllib.request.urlopen
    monkeypatch.setattr(urllib.request, "urlopen",
                        lambda request, timeout: waited.append(timeout) or urlopen(request, timeout=timeout))
    assert runner.invoke(main, ["models", "load", "emulated", "--url", server.url]).exit_code == 0
    assert waited == [660.0]  # the server waits up to 600 s for its workers: not the 30 s of other calls

    gate = tmp_path / "gate"
    add_gated_version(repo / "gated", "1", gate)
    try:
        gave_up = runner.invoke(main, ["models", "load", "gated", "--timeout", "1", "--url", server.url])
        assert gave_up.exit_code == 1  # not "cannot reach": the server is there, and still loading
        assert f"{server.url} did not answer within 1 s: what was asked may still be under way" in gave_up.output
    finally:
        gate.touch()
    eventually(lambda: httpx.get(f"{server.url}/v2/models/gated/ready").status_code == 200, "the load finished")

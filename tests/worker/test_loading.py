"""`worker.loading.VersionLoad`: a load runs on a thread of its own and is given up after its
`[loading] timeout_s`; what it loads late is closed, never served, and the version is not loaded
again while that thread still runs."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path

from sluice import wire
from sluice.repository import LoadingConfig, ModelVersion, scan_repository
from sluice.worker.loading import Loaded, LoadedModel, RepositoryModel, VersionLoad
from tests.conftest import until, write_emulated_model


class _Runner:
    def __init__(self) -> None:
        self.is_closed = False

    def warmup(self) -> list[tuple[int, float]]:
        return [(1, 0.001)]

    def close(self) -> None:
        self.is_closed = True


class _Source:
    """Loads block until `release` is set (if given); `fail` raises instead."""

    def __init__(self, release: threading.Event | None = None, fail: bool = False) -> None:
        self.release = release
        self.fail = fail
        self.runners: list[_Runner] = []

    def scan(self, name: str) -> RepositoryModel:
        return RepositoryModel([], [], [])

    def load(self, version: ModelVersion) -> LoadedModel | wire.RefusedModel:
        if self.release is not None:
            self.release.wait()
        if self.fail:
            raise MemoryError("out of device memory")
        runner = _Runner()
        self.runners.append(runner)
        return LoadedModel(version, runner)  # type: ignore[arg-type]


def _version(tmp_path: Path, timeout_s: float) -> ModelVersion:
    (version,) = scan_repository(write_emulated_model(tmp_path / "models")).versions
    return dataclasses.replace(version, loading=LoadingConfig(timeout_s=timeout_s))


def test_a_load_is_given_up_after_its_timeout_and_its_late_result_is_closed(tmp_path):
    async def main() -> None:
        release = threading.Event()
        source = _Source(release)
        loads = VersionLoad(source)
        version = _version(tmp_path, timeout_s=0.2)
        outcome = await loads.load(version)
        assert isinstance(outcome, wire.RefusedModel)
        assert "did not finish within 0.2 s ([loading] timeout_s" in outcome.reason
        again = await loads.load(version)  # not a second thread beside the hung one
        assert isinstance(again, wire.RefusedModel) and "still running on the worker" in again.reason
        release.set()
        await until(lambda: bool(source.runners) and source.runners[0].is_closed)
        await until(lambda: loads.still_running(version.key) is None)
        loaded = await loads.load(version)  # its thread is done: it can be loaded again
        assert isinstance(loaded, Loaded) and loaded.timings == [(1, 0.001)]
        assert not source.runners[1].is_closed

    asyncio.run(main())


def test_a_load_that_raises_refuses_the_version_alone(tmp_path):
    async def main() -> None:
        outcome = await VersionLoad(_Source(fail=True)).load(_version(tmp_path, timeout_s=30))
        assert isinstance(outcome, wire.RefusedModel)
        assert outcome.reason == "loading failed: MemoryError: out of device memory"

    asyncio.run(main())


_LOAD_AND_REPORT = """
import gc, json, sys
from pathlib import Path
from sluice.worker.main import RepositorySource, WorkerConfig, scan_models
config = WorkerConfig("w", "inproc://w", Path(sys.argv[1]))
report = {}
for version in sorted(scan_models(config)[0], key=lambda v: v.kind != "emulated"):
    frozen = gc.get_freeze_count()
    loaded = RepositorySource(config).load(version)
    report[version.kind] = {"loaded": type(loaded).__name__, "torch": "torch" in sys.modules,
                            "frozen_more": gc.get_freeze_count() > frozen}
print(json.dumps(report))
"""


def test_a_worker_imports_torch_only_when_it_loads_a_model_built_on_it(tmp_path):
    """A worker of emulated (or upstream, ONNX...) models starts without torch, seconds sooner and
    hundreds of MB smaller; the first generative load brings it, and freezes its module graph out
    of the garbage collector's full walks as start-up's objects are."""
    import json
    import subprocess
    import sys

    from tests.conftest import write_tiny_lm_model

    repo = write_tiny_lm_model(write_emulated_model(tmp_path / "models"))
    out = subprocess.run([sys.executable, "-c", _LOAD_AND_REPORT, str(repo)], capture_output=True, text=True,
                         timeout=120, check=True, cwd=Path(__file__).parents[2])
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["emulated"] == {"loaded": "LoadedModel", "torch": False, "frozen_more": False}
    assert report["generative"] == {"loaded": "LoadedModel", "torch": True, "frozen_more": True}

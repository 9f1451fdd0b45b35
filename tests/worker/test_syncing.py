"""`worker.syncing.startup_order`: the order a worker loads the versions it starts with, and
fits them in its memory budget."""

from __future__ import annotations

from pathlib import Path

from sluice.repository import scan_repository
from sluice.worker.syncing import startup_order
from tests.conftest import write_emulated_model


def test_each_models_newest_version_comes_before_any_older_one(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    for name, versions in (("a", ("2", "10")), ("b", ()), ("c", ("3", "4"))):
        write_emulated_model(repo, name=name)  # version 1
        for version in versions:
            (repo / name / version).mkdir()
            (repo / name / version / "SHA256SUMS").write_text("")
    order = [f"{version.name}/{version.version}" for version in startup_order(scan_repository(repo).versions)]
    assert order == ["a/10", "b/1", "c/4", "a/2", "c/3", "a/1", "c/1"]

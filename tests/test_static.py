"""The source passes its static checks, as CI runs them: ruff (lint, import order) over the
source, tests, benchmarks, examples and deploy/'s scripts, and mypy (types) over the source."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


LINTED = ["src", "tests", "benchmarks", "examples", "deploy"]


@pytest.mark.parametrize("command", [["ruff", "check", *LINTED], ["mypy", "src"]], ids=["ruff", "mypy"])
def test_the_source_passes(command: list[str]) -> None:
    run = subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]

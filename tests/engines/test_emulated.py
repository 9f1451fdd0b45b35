"""The emulated runner's settings: each `[params]` mistake refused naming the parameter."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.engines.emulated import EmulatedRunner
from sluice.errors import ConfigError
from sluice.repository import scan_repository
from tests.conftest import write_emulated_model


def _runner(tmp_path: Path, **params: object) -> EmulatedRunner:
    [version] = scan_repository(write_emulated_model(tmp_path / "models", **params)).versions  # type: ignore[arg-type]
    return EmulatedRunner(version, "cpu")


@pytest.mark.parametrize("params, fragment", [
    ({"alpah_ms": 5}, "no emulator parameter 'alpah_ms'"),  # was ignored: the default 8 ms served
    ({"alpha_ms": -5}, "alpha_ms must be a number of ms >= 0, got -5"),  # was "parameters out of range"
    ({"alpha_ms": "nan"}, "alpha_ms must be a number of ms >= 0, got nan"),
    ({"error_rate": 7}, "error_rate must be between 0 and 1, got 7"),
    ({"error_rate": "nan"}, "error_rate must be between 0 and 1"),
    ({"dims": 0}, "dims must be an integer >= 1, got 0"),
    ({"jitter": "inf"}, "jitter must be a number >= 0"),
])
def test_a_bad_emulator_parameter_is_refused_naming_it(tmp_path: Path, params: dict[str, object],
                                                       fragment: str) -> None:
    with pytest.raises(ConfigError, match="emulated: ") as raised:
        _runner(tmp_path, **params)
    assert fragment in raised.value.message


def test_good_emulator_parameters_are_taken(tmp_path: Path) -> None:
    runner = _runner(tmp_path, alpha_ms=2.0, beta_ms=0.5, error_rate=0.25, seed=3, dims=4)
    assert (runner.alpha_s, runner.error_rate, runner.dims) == (0.002, 0.25, 4)

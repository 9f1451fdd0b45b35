"""The command line's promise in `sluice --help` and the README: every option can also come from
the environment as SLUICE_<COMMAND>_<OPTION>, those that also read a shared variable
(`SLUICE_API_KEY`, `SLUICE_ADMIN_KEY`) included."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from sluice.cli import main
from tests.conftest import ServerProcess


def _options(group: click.Group, path: str) -> Iterator[tuple[str, click.Command, click.Option]]:
    for name, command in group.commands.items():
        here = f"{path}_{name.upper().replace('-', '_')}"
        if isinstance(command, click.Group):
            yield from _options(command, here)
            continue
        for param in command.params:
            if isinstance(param, click.Option) and param.name != "help":
                flag = max(param.opts, key=len).lstrip("-").split("/")[0]
                yield f"{here}_{flag.upper().replace('-', '_')}", command, param


def test_every_option_reads_its_command_and_flag_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    names = list(_options(main, "SLUICE"))
    expected = {"SLUICE_BENCH_API_KEY", "SLUICE_MODELS_STATUS_ADMIN_KEY", "SLUICE_GATEWAY_JOBS_DB"}
    assert expected <= {n for n, _, _ in names}
    for variable, command, option in names:
        monkeypatch.setenv(variable, "from-the-environment")
        assert option.resolve_envvar_value(click.Context(command)) == "from-the-environment", variable
        monkeypatch.delenv(variable)


def test_the_command_specific_variable_wins_over_the_shared_one(monkeypatch: pytest.MonkeyPatch) -> None:
    [option] = [o for n, _, o in _options(main, "SLUICE") if n == "SLUICE_BENCH_API_KEY"]
    monkeypatch.setenv("SLUICE_API_KEY", "shared")
    assert option.resolve_envvar_value(click.Context(main)) == "shared"
    monkeypatch.setenv("SLUICE_BENCH_API_KEY", "bench's own")
    assert option.resolve_envvar_value(click.Context(main)) == "bench's own"


@pytest.mark.slow
def test_models_status_takes_its_admin_key_from_its_own_variable(make_server: Callable[..., ServerProcess],
                                                                 emulated_repo: Callable[..., Path],
                                                                 tmp_path: Path) -> None:
    from sluice.gateway.tenants import hash_key, new_key

    admin_key, tenant_key = new_key(), new_key()
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[admin]\napi_keys = ["{hash_key(admin_key)}"]\n[tenants.a]\n'
                       f'api_keys = ["{hash_key(tenant_key)}"]\n')
    server = make_server(emulated_repo(alpha_ms=2, beta_ms=0.1), "--tenants", str(tenants))
    runner = CliRunner(env={"SLUICE_ADMIN_KEY": None, "SLUICE_MODELS_STATUS_ADMIN_KEY": None})
    refused = runner.invoke(main, ["models", "status", "--url", server.url])
    assert refused.exit_code == 1 and "401" in refused.output  # the server asks for the key
    hint = "give an admin key (`sluice keys create --admin`) with --admin-key or $SLUICE_ADMIN_KEY"
    assert hint in refused.output  # not "send 'Authorization: Bearer <key>'", which a command line user cannot
    a_tenants = runner.invoke(main, ["models", "status", "--url", server.url, "--admin-key", tenant_key])
    assert a_tenants.exit_code == 1 and "403: this route needs an admin key" in a_tenants.output
    assert hint in a_tenants.output
    answered = runner.invoke(main, ["models", "status", "--url", server.url],
                             env={"SLUICE_MODELS_STATUS_ADMIN_KEY": admin_key})
    assert answered.exit_code == 0, answered.output
    assert "emulated: traffic from newest version" in answered.output


@pytest.mark.parametrize("url, why", [
    ("http://[::1", "is not a URL: Invalid IPv6 URL"),
    ("http://127.0.0.1:99999", "is not a URL: Port out of range"),
    ("127.0.0.1:8000", "is not the http:// or https:// URL of a server"),
    ("ftp://127.0.0.1:8000", "is not the http:// or https:// URL of a server"),
])
@pytest.mark.parametrize("command", [["top", "--once"], ["models", "status"], ["models", "load", "m"],
                                     ["batch", "status", "batch_1"], ["bench", "--duration", "1"]])
def test_a_url_no_request_can_be_sent_to_is_a_usage_error_not_a_traceback(command: list[str], url: str,
                                                                           why: str) -> None:
    """As an operator types it: the real command line, in a process of its own."""
    run = subprocess.run([sys.executable, "-m", "sluice", *command, "--url", url], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    assert "Invalid value for '--url'" in run.stderr and f"{url!r} {why}" in run.stderr


def test_top_with_a_ca_file_that_holds_no_certificate_says_so(tmp_path: Path) -> None:
    not_pem = tmp_path / "ca.pem"
    not_pem.write_text("not a certificate\n")
    run = subprocess.run([sys.executable, "-m", "sluice", "top", "--once", "--url", "https://127.0.0.1:9",
                          "--ca-certs", str(not_pem)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert f"{not_pem} holds no PEM certificate that can be read" in run.stderr

"""The tenants file: parsing, key hashes, and `sluice keys create`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sluice.errors import ConfigError
from sluice.gateway.keyfile import add_key, list_keys, revoke_key
from sluice.gateway.tenants import hash_key, load_tenants
from sluice.priority import Priority


def test_keys_are_stored_hashed_and_found_by_the_key(tmp_path: Path):
    path = tmp_path / "tenants.toml"
    path.write_text("# our tenants\n[tenants.acme]\nweight = 2\npriority = 'interactive'\nmodels = ['minilm']\n")
    key = add_key(path, "acme")
    text = path.read_text()
    assert key not in text and hash_key(key) in text
    assert "# our tenants" in text  # comments survive
    directory = load_tenants(path)
    tenant = directory.tenant_for_key(key)
    assert tenant is not None and tenant.name == "acme" and tenant.weight == 2
    assert tenant.priority is Priority.INTERACTIVE
    assert tenant.may_use("minilm") and not tenant.may_use("emulated")
    assert directory.tenant_for_key(key + "x") is None
    assert not directory.is_admin_key(key)


def test_admin_keys_are_separate(tmp_path: Path):
    path = tmp_path / "tenants.toml"
    add_key(path, "acme")
    admin = add_key(path, None)
    directory = load_tenants(path)
    assert directory.is_admin_key(admin)
    assert directory.tenant_for_key(admin) is None


def test_metrics_are_open_unless_the_file_lists_metrics_keys(tmp_path: Path):
    path = tmp_path / "tenants.toml"
    tenant = add_key(path, "acme")
    admin = add_key(path, None)
    assert load_tenants(path).may_scrape(None)
    scraper = add_key(path, None, metrics=True)
    directory = load_tenants(path)
    assert directory.may_scrape(scraper) and directory.may_scrape(admin)
    assert not directory.may_scrape(None) and not directory.may_scrape(tenant)
    assert directory.tenant_for_key(scraper) is None and not directory.is_admin_key(scraper)
    assert 'access = "keys"' in path.read_text()


@pytest.mark.parametrize("body, message", [
    ("[tenants.a]\n[metrics]\naccess = 'public'\n", "access must be"),
    ("[tenants.a]\n[metrics]\naccess = 'open'\napi_keys = ['sha256:" + "0" * 64 + "']\n", "access is"),
    ("[tenants.a]\n[metrics]\nkeys = []\n", "unknown field"),
    ("[tenants.a]\napi_keys = ['sk-plain-text']\n", "never in plain text"),
    ("[tenants.a]\nweight = -1\n", "weight must be a number"),
    ("[tenants.a]\npriority = 'urgent'\n", "'priority' must be one of"),
    ("[tenants.a]\nrate = 3\n", "unknown field"),
    ("[tenant.a]\n", "unknown section"),
    ("[admin]\n", "defines no tenants"),
    ("[tenants.a\n", "not valid TOML"),
    ("[tenants.a]\nrequests_per_min = inf\n", "requests_per_min must be a number"),
    ("[tenants.a]\ntokens_per_min = nan\n", "tokens_per_min must be a number"),
    ("[tenants.a]\nmax_concurrent = inf\n", "max_concurrent must be a whole number"),
    ("[tenants.a]\nmax_concurrent = 1.5\n", "max_concurrent must be a whole number"),
    ("[tenants.a]\ncredit_period_s = nan\n", "credit_period_s must be a number"),
    ("[tenants.a]\ncredits_device_s = 1e400\n", "credits_device_s must be a number"),
    ("[tenants.a]\nweight = inf\n", "weight must be a number"),
    ("[tenants.a]\nweight = 0\n", r"\[tenants.a\]: weight must be a number > 0 \(a share of the devices"),
    ("[admin]\napi_key = ['sha256:" + "0" * 64 + "']\n[tenants.a]\n",
     r"\[admin\]: unknown field\(s\) \['api_key'\]; expected api_keys"),
    ("[tenants.a]\napi_keys = ['sha256:" + "z" * 64 + "']\n", r"api_keys: keys are stored as 'sha256:<64 hex digits>'"),
])
def test_a_bad_tenants_file_is_refused_with_the_reason(tmp_path: Path, body: str, message: str):
    path = tmp_path / "tenants.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=message):
        load_tenants(path)


def test_a_tenants_file_that_is_not_utf8_is_refused_with_the_reason(tmp_path: Path):
    path = tmp_path / "tenants.toml"
    path.write_bytes(b"[tenants.a]\n# caf\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_tenants(path)


def test_keys_create_keeps_the_files_permissions(tmp_path: Path):
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.acme]\n")
    path.chmod(0o644)  # read by a server that runs as another user
    add_key(path, "acme")
    assert path.stat().st_mode & 0o777 == 0o644


def test_keys_create_names_the_tenants_file_in_its_errors(tmp_path: Path):
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.acme]\n")
    with pytest.raises(ConfigError) as caught:
        add_key(path, "bad name")
    assert caught.value.message.startswith(f"{path}: [tenants.bad name]: a tenant name is")
    assert path.read_text() == "[tenants.acme]\n"
    with pytest.raises(ConfigError, match="cannot write tenants file"):
        add_key(tmp_path / "no-such-folder" / "tenants.toml", "acme")


def test_keys_create_admin_on_a_new_file_says_the_server_needs_a_tenant_too(tmp_path: Path):
    from click.testing import CliRunner

    from sluice.cli import main

    path = tmp_path / "tenants.toml"
    result = CliRunner().invoke(main, ["keys", "create", "--admin", "--tenants", str(path)])
    assert result.exit_code == 0
    assert "needs at least one tenant" in result.output
    added = CliRunner().invoke(main, ["keys", "create", "acme", "--tenants", str(path)])
    assert added.exit_code == 0 and "needs at least one tenant" not in added.output
    assert load_tenants(path).tenants.keys() == {"acme"}


def test_keys_create_takes_one_of_a_tenant_admin_or_metrics(tmp_path: Path):
    from click.testing import CliRunner

    from sluice.cli import main

    path = tmp_path / "tenants.toml"
    runner = CliRunner()
    assert runner.invoke(main, ["keys", "create", "acme", "--tenants", str(path)]).exit_code == 0
    both = runner.invoke(main, ["keys", "create", "acme", "--metrics", "--tenants", str(path)])
    assert both.exit_code == 2 and "one of them" in both.output
    created = runner.invoke(main, ["keys", "create", "--metrics", "--tenants", str(path)])
    assert created.exit_code == 0 and "a metrics key" in created.output
    key = created.output.splitlines()[0]
    directory = load_tenants(path)
    assert directory.may_scrape(key) and not directory.may_scrape(None)


def _sluice(*args: str) -> subprocess.Popen[str]:
    """The real `sluice` command line, in a process of its own."""
    return subprocess.Popen([sys.executable, "-m", "sluice", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_keys_created_at_the_same_time_are_all_kept(tmp_path: Path):
    """Each `sluice keys create` prints its key as stored: one run beside another must not write
    the file over with what it read before the other's key was added."""
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.acme]\n")
    runs = [_sluice("keys", "create", f"team-{i % 4}", "--tenants", str(path)) for i in range(12)]
    printed = []
    for run in runs:
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
        printed.append(out.splitlines()[0])
    directory = load_tenants(path)
    assert all(directory.tenant_for_key(key) is not None for key in printed)
    assert sum(len(t.key_hashes) for t in directory.tenants.values()) == 12


def test_keys_create_on_a_file_it_cannot_read_says_why_without_a_traceback(tmp_path: Path):
    path = tmp_path / "tenants.toml"
    path.write_bytes(b"[tenants.acme]\nweight = \xff\n")
    run = _sluice("keys", "create", "acme", "--tenants", str(path))
    out, err = run.communicate(timeout=120)
    assert run.returncode == 1 and out == ""
    assert err.strip() == f"Error: {path} is not UTF-8 text: invalid start byte at byte 24"
    assert path.read_bytes() == b"[tenants.acme]\nweight = \xff\n"


def test_keys_create_admin_on_a_file_the_server_would_refuse_says_why(tmp_path: Path):
    from click.testing import CliRunner

    from sluice.cli import main

    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.acme]\nweigth = 2\n")
    result = CliRunner().invoke(main, ["keys", "create", "--admin", "--tenants", str(path)])
    assert result.exit_code == 0
    assert "unknown field(s) ['weigth']" in result.output
    assert "needs at least one tenant" not in result.output


def test_a_tenant_may_name_only_models_the_repository_has(tmp_path: Path):
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.a]\nmodels = ['minilm']\n[tenants.b]\nmodels = ['minlm', 'tiny-lm']\n")
    with pytest.raises(ConfigError) as caught:
        load_tenants(path, known_models={"minilm", "tiny-lm"})
    assert caught.value.message == (f"{path}: [tenants.b] models: the model repository has no model 'minlm' "
                                    "(it has minilm, tiny-lm)")
    assert load_tenants(path).tenants["b"].models == {"minlm", "tiny-lm"}  # a cluster's gateway cannot tell


def test_keys_list_shows_whose_each_key_is_and_revoke_takes_the_key_or_its_hash(tmp_path: Path):
    path = tmp_path / "tenants.toml"
    path.write_text("# our teams\n[tenants.acme]\nweight = 2  # twice the others\n")
    first, second = add_key(path, "acme"), add_key(path, "acme")
    admin = add_key(path, None)
    listed = _sluice("keys", "list", "--tenants", str(path)).communicate(timeout=120)[0].splitlines()
    assert [line.split() for line in listed] == [["admin", hash_key(admin)[:23]],
                                                ["tenant", "acme", hash_key(first)[:23]],
                                                ["tenant", "acme", hash_key(second)[:23]]]

    by_hash = _sluice("keys", "revoke", hash_key(first)[:23], "--tenants", str(path))
    _, said = by_hash.communicate(timeout=120)
    assert by_hash.returncode == 0 and f"Revoked the key {hash_key(first)[:23]} (tenant acme)" in said
    assert load_tenants(path).tenant_for_key(first) is None
    assert load_tenants(path).tenant_for_key(second) is not None
    by_key = _sluice("keys", "revoke", admin, "--tenants", str(path))
    assert by_key.wait(timeout=120) == 0 and not load_tenants(path).is_admin_key(admin)
    assert "# twice the others" in path.read_text()  # the file's comments stay

    again = _sluice("keys", "revoke", first, "--tenants", str(path))
    _, said = again.communicate(timeout=120)
    assert again.returncode == 1 and f"Error: {path} lists no such key" in said
    too_short = _sluice("keys", "revoke", "sha256:0", "--tenants", str(path))
    _, said = too_short.communicate(timeout=120)
    assert too_short.returncode == 1 and "at least 8 hex digits" in said and "Traceback" not in said


def test_keys_create_and_revoke_change_the_file_a_link_points_to(tmp_path: Path):
    """`sluice serve --tenants link` reads the file the link points to (as a mounted secret's
    `..data` link does): the key must land there, and the link stay a link."""
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "tenants.toml"
    target.write_text("[tenants.acme]\n")
    link = tmp_path / "tenants.toml"
    link.symlink_to(target)
    key = add_key(link, "acme")
    assert link.is_symlink() and load_tenants(target).tenant_for_key(key) is not None
    revoke_key(link, key)
    assert link.is_symlink() and load_tenants(target).tenant_for_key(key) is None


def test_keys_create_and_revoke_leave_a_read_only_tenants_file_as_it_is(tmp_path: Path):
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.acme]\n")
    key = add_key(path, "acme")
    before = path.read_text()
    path.chmod(0o444)
    run = _sluice("keys", "create", "acme", "--tenants", str(path))
    _, said = run.communicate(timeout=120)
    assert run.returncode == 1 and said.strip() == (f"Error: tenants file {path} is read-only (mode 0444): make it "
                                                    "writable to change its keys")
    with pytest.raises(ConfigError, match="read-only"):
        revoke_key(path, key)
    assert [stored.owner for stored in list_keys(path)] == ["tenant acme"]  # it can still be read
    assert path.read_text() == before and path.stat().st_mode & 0o777 == 0o444

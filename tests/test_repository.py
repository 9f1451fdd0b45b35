"""The model repository: parsing model.toml and refusing versions whose files do not match SHA256SUMS."""

from __future__ import annotations

import httpx
import pytest

from sluice.errors import ConfigError
from sluice.repository import demo_repository, scan_repository, verify, write_manifest


def _model(repo, name="m", kind="emulated", extra=""):
    folder = repo / name
    folder.mkdir(parents=True)
    config = f'kind = "{kind}"\n[batching]\nmax_batch_size = 8\n[slo]\ndefault_ms = 250\n{extra}'
    (folder / "model.toml").write_text(config)
    return folder


def _version(model_dir, version, files):
    folder = model_dir / version
    folder.mkdir()
    for name, content in files.items():
        (folder / name).write_text(content)
    write_manifest(folder, folder / "SHA256SUMS")
    return folder


def test_scan_reads_limits_slo_and_versions(tmp_path):
    model = _model(tmp_path)
    _version(model, "1", {"weights.bin": "a"})
    _version(model, "2", {"weights.bin": "b"})
    repo = scan_repository(tmp_path)
    assert [v.version for v in repo.versions] == ["1", "2"]
    assert repo.versions[0].batching.max_batch_size == 8
    assert repo.versions[0].slo_s == 0.25
    for version in repo.versions:
        verify(version)


def test_checksum_mismatch_refuses_that_version_with_a_clear_error(tmp_path):
    model = _model(tmp_path)
    _version(model, "1", {"weights.bin": "good"})
    bad = _version(model, "2", {"weights.bin": "good"})
    (bad / "weights.bin").write_text("tampered")
    good_version, bad_version = scan_repository(tmp_path).versions
    verify(good_version)
    with pytest.raises(ConfigError, match=r"checksum mismatch for weights\.bin"):
        verify(bad_version)


def test_unlisted_and_missing_files_are_refused(tmp_path):
    model = _model(tmp_path)
    folder = _version(model, "1", {"weights.bin": "x"})
    (folder / "extra.bin").write_text("sneaky")
    with pytest.raises(ConfigError, match="not in SHA256SUMS"):
        verify(scan_repository(tmp_path).versions[0])
    (folder / "extra.bin").unlink()
    (folder / "weights.bin").unlink()
    with pytest.raises(ConfigError, match="missing"):
        verify(scan_repository(tmp_path).versions[0])


def test_bad_config_is_refused_per_version_not_fatal(tmp_path):
    _model(tmp_path, "broken", kind="nope")
    (tmp_path / "broken" / "1").mkdir()
    good = _model(tmp_path, "good")
    _version(good, "1", {})
    repo = scan_repository(tmp_path)
    assert [v.name for v in repo.versions] == ["good"]
    assert repo.refused[0].name == "broken" and "kind must be one of" in repo.refused[0].reason


def test_demo_repository_verifies(tmp_path, monkeypatch):
    from sluice.engines.generative.tiny import ensure_tiny_lm

    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    repo = scan_repository(demo_repository())
    assert {v.name for v in repo.versions} == {"minilm", "emulated", "tiny-lm"}
    for version in repo.versions:
        if version.generator == "tiny-lm":
            ensure_tiny_lm(version.weights_dir)  # generated on first use, then checked like any weights
        verify(version)


def test_server_serves_the_good_version_and_reports_the_refused_one(make_server, tmp_path):
    model = _model(tmp_path / "models", "emulated", extra="[params]\nalpha_ms = 1\n")
    _version(model, "1", {"notes.txt": "v1"})
    bad = _version(model, "2", {"notes.txt": "v2"})
    (bad / "notes.txt").write_text("corrupted")
    server = make_server(tmp_path / "models")
    metadata = httpx.get(f"{server.url}/v2/models/emulated").json()
    assert metadata["versions"] == ["1"]
    assert httpx.get(f"{server.url}/v2/models/emulated/versions/2/ready").status_code == 404
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
    assert httpx.post(f"{server.url}/v2/models/emulated/infer", json=body).json()["model_version"] == "1"
    assert "checksum mismatch for notes.txt" in server.log()


@pytest.mark.parametrize(
    "config, fragments",
    [
        ('kind = [\n', ["model.toml", "not valid TOML"]),
        ('kind = "emulated"\n[batching]\nmax_batch_size = "32"\n', ["model.toml", "max_batch_size", "'32'"]),
        ('kind = "emulated"\n[batching]\nmax_batch_cost = true\n', ["model.toml", "max_batch_cost"]),
        ('kind = "emulated"\n[batching]\nmax_batch = 8\n', ["model.toml", "'max_batch'"]),
        ('kind = "emulated"\nslo = 5\n', ["model.toml", "[slo]"]),
        ('kind = "emulated"\n[slo]\ndefault_ms = "fast"\n', ["model.toml", "default_ms"]),
        ('kind = "emulated"\nparams = [1]\n', ["model.toml", "[params]"]),
        ('kind = "emulated"\nplatform = 3\n', ["model.toml", "platform"]),
        ('kind = "embedding"\n[weights]\npackage = "no_such.pkg"\n', ["model.toml", "no_such.pkg"]),
        # a misspelt setting is a mistake named, not a default silently used
        ('kind = "emulated"\n[batchng]\nmax_batch_size = 4\n', ["model.toml", "no setting 'batchng'"]),
        ('kind = "emulated"\nkidn = "onnx"\n', ["model.toml", "no setting 'kidn'"]),
        ('kind = "emulated"\n[slo]\ndefault_msec = 5\n', ["model.toml", "[slo] has no setting 'default_msec'"]),
        ('kind = "embedding"\n[weights]\npackag = "x"\n', ["model.toml", "[weights] has no setting 'packag'"]),
        # an SLO that is no number of milliseconds made every request a 500
        ('kind = "emulated"\n[slo]\ndefault_ms = nan\n', ["model.toml", "default_ms", "nan"]),
        ('kind = "emulated"\n[slo]\ndefault_ms = inf\n', ["model.toml", "default_ms", "inf"]),
    ],
)
def test_a_broken_model_toml_refuses_that_model_naming_file_and_field(tmp_path, config, fragments):
    broken = tmp_path / "broken"
    (broken / "1").mkdir(parents=True)
    (broken / "2").mkdir()
    (broken / "model.toml").write_text(config)
    _version(_model(tmp_path, "good"), "1", {})
    repo = scan_repository(tmp_path)
    assert [v.name for v in repo.versions] == ["good"]
    assert [(r.name, r.version) for r in repo.refused] == [("broken", "1"), ("broken", "2")]
    for fragment in fragments:
        assert fragment in repo.refused[0].reason


def test_result_caching_is_on_for_local_runners_off_for_external_ones_and_settable(tmp_path):
    tensors = _TEXT_IN + _SCORE_OUT
    for name, kind, extra in [("local", "emulated", ""), ("external", "http-single", ""),
                              ("off", "emulated", "[cache]\nenabled = false\n"),
                              ("on", "http-single", "[cache]\nenabled = true\n"), ("graph", "onnx", ""),
                              ("code", "python", tensors),
                              ("code-on", "python", "[cache]\nenabled = true\n" + tensors)]:
        _version(_model(tmp_path, name, kind, extra), "1", {"w.bin": name})
    versions = {v.name: v for v in scan_repository(tmp_path).versions}
    assert {name: bool(v.cache_revision) for name, v in versions.items()} == {
        "local": True, "external": False, "off": False, "on": True, "graph": True, "code": False, "code-on": True}


def test_new_weights_under_the_same_version_number_get_a_new_cache_revision(tmp_path):
    model = _model(tmp_path)
    version = _version(model, "1", {"weights.bin": "a"})
    before = scan_repository(tmp_path).versions[0].cache_revision
    (version / "weights.bin").write_text("b")
    write_manifest(version, version / "SHA256SUMS")
    new_weights = scan_repository(tmp_path).versions[0].cache_revision
    (model / "model.toml").write_text((model / "model.toml").read_text() + "[params]\nalpha_ms = 3.0\n")
    new_params = scan_repository(tmp_path).versions[0].cache_revision
    assert len({before, new_weights, new_params}) == 3


def test_a_version_toml_overrides_the_models_settings_for_that_version_only(tmp_path):
    model = _model(tmp_path, extra="[params]\nalpha_ms = 8.0\nbeta_ms = 0.5\n")
    _version(model, "1", {"w.bin": "a"})
    two = _version(model, "2", {"w.bin": "b"})
    (two / "version.toml").write_text("[params]\nerror_rate = 0.25\n[slo]\ndefault_ms = 500\n")
    one, two_parsed = scan_repository(tmp_path).versions
    assert dict(one.params) == {"alpha_ms": 8.0, "beta_ms": 0.5} and one.slo_s == 0.25
    assert dict(two_parsed.params) == {"alpha_ms": 8.0, "beta_ms": 0.5, "error_rate": 0.25}
    assert two_parsed.slo_s == 0.5 and two_parsed.batching.max_batch_size == 8
    verify(two_parsed)  # version.toml is settings, not a weight file the manifest must list


@pytest.mark.parametrize(("own", "fragment"), [
    ("[routing]\ntraffic = { 2 = 100 }\n", "[routing] belongs in the model's model.toml"),
    ("[params\n", "not valid TOML"),
    ("[batching]\nmax_batch_size = 0\n", "max_batch_size must be a positive integer")])
def test_a_bad_version_toml_refuses_that_version_naming_its_file(tmp_path, own, fragment):
    model = _model(tmp_path)
    _version(model, "1", {"w.bin": "a"})
    (_version(model, "2", {"w.bin": "b"}) / "version.toml").write_text(own)
    repo = scan_repository(tmp_path)
    assert [v.version for v in repo.versions] == ["1"]
    assert repo.refused[0].version == "2" and "version.toml" in repo.refused[0].reason
    assert fragment in repo.refused[0].reason


def test_routing_declares_a_split_that_does_not_change_the_cache_revision(tmp_path):
    model = _model(tmp_path)
    _version(model, "1", {"w.bin": "a"})
    before = scan_repository(tmp_path).versions[0]
    assert before.routing is None
    (model / "model.toml").write_text((model / "model.toml").read_text()
                                      + "[routing]\ntraffic = { 1 = 90, 2 = 10 }\nsticky = false\n")
    after = scan_repository(tmp_path).versions[0]
    assert after.routing is not None and after.routing.traffic == {"1": 90.0, "2": 10.0}
    assert after.routing.sticky is False and after.cache_revision == before.cache_revision


def test_loading_settings_default_to_loading_at_start_and_never_unloading(tmp_path):
    _version(_model(tmp_path, "eager"), "1", {"w.bin": "x"})
    _version(_model(tmp_path, "lazy", extra="[loading]\non_demand = true\n"), "1", {"w.bin": "x"})
    _version(_model(tmp_path, "short", extra="[loading]\nidle_unload_s = 30\n"), "1", {"w.bin": "x"})
    loading = {v.name: (v.loading.on_demand, v.loading.idle_unload_s) for v in scan_repository(tmp_path).versions}
    assert loading == {"eager": (False, 0.0), "lazy": (True, 600.0), "short": (False, 30.0)}


@pytest.mark.parametrize(("table", "body", "fragment"), [
    ("cache", "enabled = 1", "enabled must be true or false"),
    ("cache", "size_mb = 3", "[cache] has no setting 'size_mb'"),
    ("routing", "traffic = { latest = 100 }", "'latest' is not a version number"),
    ("routing", "traffic = { 1 = -1 }", "weight must be a number >= 0"),
    ("routing", "traffic = { 1 = 0 }", "at least one version needs a weight above 0"),
    ("routing", "traffic = { 1 = inf }", "weight must be a number >= 0"),
    ("routing", "traffic = { 1 = 1, 2 = nan }", "weight must be a number >= 0"),
    ("routing", "traffic = { 1 = 1e308, 2 = 1e308 }", "the weights add up to more than a number can hold"),
    ("routing", "traffic = 100", "traffic must be a table"),
    ("routing", "sticky = 'yes'\ntraffic = { 1 = 1 }", "sticky must be true or false"),
    ("routing", "weights = { 1 = 1 }", "[routing] has no setting 'weights'"),
    ("loading", "on_demand = 1", "on_demand must be true or false"),
    ("loading", "idle_unload_s = -1", "idle_unload_s must be a number of seconds >= 0"),
    ("loading", "idle_unload_s = 'soon'", "idle_unload_s must be a number of seconds >= 0"),
    ("loading", "idle_unload_s = nan", "idle_unload_s must be a number of seconds >= 0"),
    ("loading", "preload = true", "[loading] has no setting 'preload'")])
def test_a_bad_cache_routing_or_loading_table_refuses_the_model(tmp_path, table, body, fragment):
    _version(_model(tmp_path, extra=f"[{table}]\n{body}\n"), "1", {"w.bin": "x"})
    repo = scan_repository(tmp_path)
    assert not repo.versions and fragment in repo.refused[0].reason


_TEXT_IN = '[[inputs]]\nname = "text"\ndatatype = "BYTES"\n'
_SCORE_OUT = '[[outputs]]\nname = "score"\ndatatype = "FP32"\ndims = [3, -1]\n'


def test_a_python_models_tensors_are_read_with_the_batch_dimension_first(tmp_path):
    _version(_model(tmp_path, kind="python", extra=_TEXT_IN + _SCORE_OUT), "1", {"model.py": ""})
    version = scan_repository(tmp_path).versions[0]
    assert [(s.name, s.datatype, s.shape) for s in version.inputs] == [("text", "BYTES", (-1,))]
    assert [(s.name, s.datatype, s.shape) for s in version.outputs] == [("score", "FP32", (-1, 3, -1))]
    assert not version.is_cached  # the user's code may not answer alike twice: caching is asked for


@pytest.mark.parametrize(("kind", "extra", "fragment"), [
    ("python", _SCORE_OUT, "a python model needs [[inputs]] tables"),
    ("python", _TEXT_IN, "a python model needs [[outputs]] tables"),
    ("python", _TEXT_IN + _SCORE_OUT.replace("FP32", "FLOAT"), "datatype must be one of BOOL"),
    ("python", _TEXT_IN + _SCORE_OUT.replace("[3, -1]", "[0]"), "dims must be a list of sizes"),
    ("python", _TEXT_IN + _TEXT_IN + _SCORE_OUT, "not used twice; got 'text'"),
    ("python", _TEXT_IN + 'shape = [1]\n' + _SCORE_OUT, "has no setting 'shape'"),
    ("onnx", _TEXT_IN, "[[inputs]] is for python models (the ONNX graph declares them)"),
    ("emulated", _SCORE_OUT, "[[outputs]] is for python models (the emulated runner's are fixed)"),
])
def test_bad_tensor_declarations_refuse_the_model(tmp_path, kind, extra, fragment):
    _version(_model(tmp_path, kind=kind, extra=extra), "1", {"model.py": ""})
    repo = scan_repository(tmp_path)
    assert not repo.versions and fragment in repo.refused[0].reason, repo.refused


def test_a_version_folder_not_named_by_a_plain_number_is_refused_naming_it_and_the_others_load(tmp_path):
    model = _model(tmp_path)
    for version in ("1", "01", "\u00b2", "v2", "latest"):  # "²".isdigit(), but int("²") raised: no server started
        _version(model, version, {})
    (model / ".ipynb_checkpoints").mkdir()  # hidden folders are not versions, nor mistakes
    repo = scan_repository(tmp_path)
    assert [v.version for v in repo.versions] == ["1"]
    refused = {r.version: r.reason for r in repo.refused}
    assert sorted(refused) == sorted(["01", "\u00b2", "v2", "latest"])
    assert all("not a version folder" in reason and str(model) in reason for reason in refused.values())


def test_a_manifest_that_is_not_text_is_refused_naming_it(tmp_path):
    folder = _version(_model(tmp_path), "1", {"w.bin": "x"})
    (folder / "SHA256SUMS").write_bytes(b"\xff\xfe\x00")
    [version] = scan_repository(tmp_path).versions
    with pytest.raises(ConfigError, match="SHA256SUMS: not a SHA256SUMS manifest \\(not UTF-8 text"):
        verify(version)


def test_a_mistake_in_model_toml_is_named_there_for_a_version_with_its_own_settings(tmp_path):
    model = _model(tmp_path, extra="[params]\nalpha_ms = 8.0\n")
    (model / "model.toml").write_text((model / "model.toml").read_text().replace("default_ms = 250", "default_ms = -3"))
    _version(model, "1", {"w.bin": "a"})
    (_version(model, "2", {"w.bin": "b"}) / "version.toml").write_text("[params]\nalpha_ms = 1.0\n")
    _version(model, "3", {"w.bin": "c"})
    (model / "3" / "version.toml").write_text("[slo]\ndefault_ms = 0\n")  # its own mistake
    reasons = {r.version: r.reason for r in scan_repository(tmp_path).refused}
    # version 2 only changes [params]: the SLO is model.toml's, not its version.toml's
    assert reasons["2"] == reasons["1"] and reasons["2"].startswith(f"{model / 'model.toml'}: [slo] default_ms")
    assert reasons["3"].startswith(f"{model / '3' / 'version.toml'}: [slo] default_ms must be a positive number, got 0")

"""The model repository: a folder of models, each with a `model.toml` and numbered versions.

    models/
      minilm/
        model.toml        runner kind, batching limits, SLO, where the weights are, result caching,
                          the traffic split between versions ([routing])
        1/
          SHA256SUMS      "<sha256>  <path>" per weight file, checked before load
          version.toml    optional: settings of this version that differ from model.toml's

A version's weights are its own folder, or (`[weights] package = ...`) the data folder of an
installed Python package, so large files are referenced rather than copied. A version whose
manifest does not match its files is refused with the reason; the others still load.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from sluice import wire
from sluice.errors import ConfigError

MANIFEST = "SHA256SUMS"
VERSION_CONFIG = "version.toml"
RUNNER_KINDS = ("emulated", "embedding", "http-single", "generative", "openai-upstream", "onnx", "python")
WEIGHTLESS_KINDS = ("http-single", "openai-upstream")
"""Runner kinds that load no files: a version folder without a SHA256SUMS manifest is fine."""
UNCACHED_KINDS = ("http-single", "openai-upstream", "python")
"""Runner kinds whose results are not cached unless their `model.toml` says `[cache] enabled = true`:
sluice cannot know that an external service, or a user's own code, answers the same input the
same way."""
TENSOR_DATATYPES = (*wire.DATATYPES, "BYTES")
"""The KServe datatypes a model's declared inputs and outputs may have (`[[inputs]]`)."""
DEFAULT_LOAD_TIMEOUT_S = 300.0
"""`[loading] timeout_s` unless set: under the 600 s a gateway waits for a worker's load, so an
admin's `load` that runs out answers with the reason rather than with a worker that did not answer."""


@dataclass(frozen=True, slots=True)
class BatchingConfig:
    max_batch_size: int = 32
    max_batch_cost: int = 8192
    """Upper bound on a batch's padded cost: items x longest item, in elements or tokens."""
    max_queue_items: int = 4096
    """A hard cap on queued items per model, behind the work-based bound."""


@dataclass(frozen=True, slots=True)
class LoadingConfig:
    on_demand: bool = False
    """Not loaded when the worker starts: its first request loads it (and is answered 503 with
    `Retry-After` meanwhile, as every request until it is ready)."""
    idle_unload_s: float = 0.0
    """Unloaded after this long without a request, to be loaded again on demand (0: never)."""
    timeout_s: float = DEFAULT_LOAD_TIMEOUT_S
    """A load (files checked, weights loaded, warm-up) not done by then is given up: the version is
    refused with that reason and the worker's other loads go on (`worker.syncing`)."""


@dataclass(frozen=True, slots=True)
class ModelVersion:
    name: str
    version: str
    kind: str
    platform: str
    batching: BatchingConfig
    slo_s: float
    weights_dir: Path
    manifest_path: Path
    params: Mapping[str, Any] = field(default_factory=dict)
    generator: str | None = None
    """Weights that sluice generates on first use (the demo `tiny-lm`), into `weights_dir`."""
    upstream: Mapping[str, Any] = field(default_factory=dict)
    """`[upstream]`: the server an `openai-upstream` model forwards to."""
    is_cached: bool = False
    """`[cache] enabled`: its deterministic results may be answered from the gateway's result cache."""
    revision: str = ""
    """A digest of the version's settings and weights manifest: results cached under one revision
    are never served for another (new weights under the same version number, changed params)."""
    routing: wire.Routing | None = None
    """The model's `[routing]`: how requests that name no version are split among its versions."""
    loading: LoadingConfig = field(default_factory=lambda: LoadingConfig())
    """`[loading]`: when the version is loaded and unloaded."""
    inputs: tuple[wire.TensorSpec, ...] = ()
    """`[[inputs]]`: the named tensors a `python` model takes, the batch dimension first (-1)."""
    outputs: tuple[wire.TensorSpec, ...] = ()
    """`[[outputs]]`: the named tensors a `python` model gives."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.name, self.version)

    @property
    def cache_revision(self) -> str:
        """What `wire.ModelInfo.cache_revision` carries: the revision, or "" if never cached."""
        return self.revision if self.is_cached else ""


@dataclass(frozen=True, slots=True)
class RefusedVersion:
    name: str
    version: str
    reason: str


@dataclass(frozen=True, slots=True)
class Repository:
    root: Path
    versions: tuple[ModelVersion, ...]
    refused: tuple[RefusedVersion, ...]


def demo_repository() -> Path:
    """The demo repository that ships inside the package."""
    return Path(__file__).parent / "demo_models"


def footprint_bytes(version: ModelVersion) -> int:
    """About what a version takes in memory once loaded: its weight files, and a generative
    model's KV cache (`[params] kv_cache_mb`). What a worker's model memory budget counts."""
    size = 0
    if version.kind not in WEIGHTLESS_KINDS and version.weights_dir.is_dir():
        for path in version.weights_dir.rglob("*"):
            with contextlib.suppress(OSError):
                if path.is_file():
                    size += path.stat().st_size
    kv_mb = version.params.get("kv_cache_mb", 0) if version.kind == "generative" else 0
    return size + (int(float(kv_mb) * 1024 * 1024) if _is_number(kv_mb) else 0)


def fingerprints(root: Path) -> dict[str, int]:
    """Each model folder's fingerprint: it changes when a file in it (its `model.toml`, a version
    folder's files) is added, removed or modified. Two of them tell which models to load again."""
    found: dict[str, int] = {}
    if not root.is_dir():
        return found
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        entries = []
        for path in sorted(model_dir.rglob("*")):
            with contextlib.suppress(OSError):  # removed while we looked: the next look sees it gone
                stat = path.stat()
                entries.append((str(path.relative_to(model_dir)), stat.st_mtime_ns, stat.st_size))
        found[model_dir.name] = hash(tuple(entries))
    return found


def model_names(root: Path) -> set[str]:
    """The models in the repository at `root`: its folders that hold a `model.toml` (loaded or
    not, valid or not)."""
    if not root.is_dir():
        return set()
    return {p.name for p in root.iterdir()
            if p.is_dir() and not p.name.startswith((".", "_")) and (p / "model.toml").is_file()}


def scan_repository(root: Path) -> Repository:
    """Read every `model.toml` and list the versions. Does not hash weights (see `verify`)."""
    if not root.is_dir():
        raise ConfigError(f"model repository {str(root)!r} is not a folder")
    versions: list[ModelVersion] = []
    refused: list[RefusedVersion] = []
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        config_path = model_dir / "model.toml"
        if not config_path.is_file():
            continue
        folders = [p for p in model_dir.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))]
        version_dirs = sorted((p for p in folders if _is_version_name(p.name)), key=_num)
        refused += [RefusedVersion(model_dir.name, p.name, f"{p}: not a version folder: versions are folders named "
                                   "by a number without leading zeros (1/, 2/, ...)")
                    for p in sorted(folders) if not _is_version_name(p.name)]
        try:
            config = _read_config(config_path)
        except ConfigError as exc:  # this model's versions are refused; the other models still load
            names = [v.name for v in version_dirs] or ["-"]
            refused += [RefusedVersion(model_dir.name, version, exc.message) for version in names]
            continue
        if not version_dirs:
            refused.append(RefusedVersion(model_dir.name, "-", "no version folders (1/, 2/, ...)"))
        for version_dir in version_dirs:
            try:
                versions.append(_parse_version(model_dir.name, version_dir, config, config_path))
            except ConfigError as exc:
                refused.append(RefusedVersion(model_dir.name, version_dir.name, exc.message))
    return Repository(root=root, versions=tuple(versions), refused=tuple(refused))


def _read_config(config_path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(config_path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{config_path}: not valid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{config_path}: not UTF-8 text: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"{config_path}: cannot be read: {exc.strerror}") from exc


def verify(version: ModelVersion) -> None:
    """Check the version's files against its SHA256SUMS manifest; raise ConfigError on mismatch."""
    if not version.manifest_path.is_file():
        if version.kind in WEIGHTLESS_KINDS:
            return
        raise ConfigError(f"{version.name} v{version.version}: missing {MANIFEST} manifest")
    try:
        text = version.manifest_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{version.manifest_path}: not a {MANIFEST} manifest (not UTF-8 text: {exc.reason} "
                          f"at byte {exc.start})") from exc
    listed = parse_manifest(text, version.manifest_path)
    for rel_path, expected in listed.items():
        path = version.weights_dir / rel_path
        if not path.is_file():
            raise ConfigError(f"{version.name} v{version.version}: {rel_path} is listed in {MANIFEST} but missing")
        actual = sha256_file(path)
        if actual != expected:
            raise ConfigError(
                f"{version.name} v{version.version}: checksum mismatch for {rel_path} "
                f"(manifest {expected[:12]}..., file {actual[:12]}...); refusing to load"
            )
    if version.weights_dir == version.manifest_path.parent:
        unlisted = [
            str(p.relative_to(version.weights_dir))
            for p in version.weights_dir.rglob("*")
            if p.is_file() and p.name not in (MANIFEST, VERSION_CONFIG)
            and str(p.relative_to(version.weights_dir)) not in listed
        ]
        if unlisted:
            raise ConfigError(f"{version.name} v{version.version}: files not in {MANIFEST}: {', '.join(unlisted)}")


def parse_manifest(text: str, path: Path) -> dict[str, str]:
    entries: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split(maxsplit=1)
        if len(parts) != 2 or len(parts[0]) != 64:
            raise ConfigError(f"{path}:{number}: expected '<sha256>  <path>'")
        entries[parts[1].strip().lstrip("*")] = parts[0].lower()
    return entries


def write_manifest(weights_dir: Path, manifest_path: Path, files: list[Path] | None = None) -> str:
    """Write a SHA256SUMS for `files` (default: every file under `weights_dir`)."""
    chosen = files if files is not None else sorted(
        p for p in weights_dir.rglob("*") if p.is_file() and p.name != MANIFEST
    )
    lines = [f"{sha256_file(p)}  {p.relative_to(weights_dir)}" for p in chosen]
    text = "\n".join(lines) + ("\n" if lines else "")
    manifest_path.write_text(text)
    return text


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _num(path: Path) -> int:
    return int(path.name)


def _is_version_name(name: str) -> bool:
    """A version folder's name: a number in ASCII digits, without leading zeros ("1", not "01" or "¹")."""
    return name.isascii() and name.isdigit() and (name == "0" or not name.startswith("0"))


MODEL_SETTINGS = ("kind", "platform", "batching", "slo", "cache", "weights", "loading", "params", "routing",
                  "upstream", "inputs", "outputs")
"""What a `model.toml` (or a `version.toml`) may set: anything else is a mistake, not ignored."""


def _check_settings(config: dict[str, Any], config_path: Path) -> None:
    unknown = sorted(set(config) - set(MODEL_SETTINGS))
    if unknown:
        raise ConfigError(f"{config_path}: no setting {unknown[0]!r} (it may set {', '.join(MODEL_SETTINGS)})")
    for table, known in (("slo", ("default_ms",)), ("weights", ("package", "subdir", "generate"))):
        value = config.get(table)
        extra = sorted(set(value) - set(known)) if isinstance(value, dict) else []
        if extra:
            raise ConfigError(f"{config_path}: [{table}] has no setting {extra[0]!r} (it has {', '.join(known)})")


def _parse_version(name: str, version_dir: Path, config: dict[str, Any], config_path: Path) -> ModelVersion:
    """One version's settings from its model's `model.toml` and its own `version.toml`, if any; a
    ConfigError naming the file and the field for anything of the wrong type or out of range."""
    _check_settings(config, config_path)
    routing = _routing(_table(config, "routing", config_path), config_path)
    own_path = version_dir / VERSION_CONFIG
    if not own_path.is_file():
        return _version_of(name, version_dir, config, config_path, routing)
    own = _read_config(own_path)
    _check_settings(own, own_path)
    try:  # errors name the file with the setting that wins
        return _version_of(name, version_dir, _merge(config, own, own_path), own_path, routing)
    except ConfigError as exc:
        try:  # a mistake in model.toml that version.toml leaves as it is: model.toml's to name
            _version_of(name, version_dir, config, config_path, routing)
        except ConfigError as model_exc:
            if model_exc.message.replace(str(config_path), str(own_path), 1) == exc.message:
                raise model_exc from None
        raise


def _version_of(name: str, version_dir: Path, config: dict[str, Any], config_path: Path,
                routing: wire.Routing | None) -> ModelVersion:
    """`_parse_version` of the settings `config`, read from `config_path` (the file errors name)."""
    kind = config.get("kind")
    if kind not in RUNNER_KINDS:
        raise ConfigError(f"{config_path}: kind must be one of {', '.join(RUNNER_KINDS)}, got {kind!r}")
    params, weights = _table(config, "params", config_path), _table(config, "weights", config_path)
    batching = _batching(_table(config, "batching", config_path), kind, params, config_path)
    slo_ms = _table(config, "slo", config_path).get("default_ms", 1000)
    if not _is_number(slo_ms) or not math.isfinite(slo_ms) or slo_ms <= 0:
        raise ConfigError(f"{config_path}: [slo] default_ms must be a positive number, got {slo_ms!r}")
    platform = config.get("platform", f"sluice_{kind}")
    if not isinstance(platform, str):
        raise ConfigError(f"{config_path}: platform must be a string, got {platform!r}")
    is_cached = _cache_enabled(_table(config, "cache", config_path), kind, config_path)
    inputs = _tensor_specs(config, "inputs", kind, config_path)
    outputs = _tensor_specs(config, "outputs", kind, config_path)
    return ModelVersion(
        name=name,
        version=version_dir.name,
        kind=kind,
        platform=platform,
        batching=batching,
        slo_s=float(slo_ms) / 1000.0,
        weights_dir=_weights_dir(version_dir, weights, config_path),
        manifest_path=version_dir / MANIFEST,
        params=params,
        generator=weights.get("generate"),
        upstream=_table(config, "upstream", config_path),
        is_cached=is_cached,
        revision=_revision({k: v for k, v in config.items() if k not in ("routing", "loading")},
                           version_dir / MANIFEST),
        routing=routing,
        loading=_loading(_table(config, "loading", config_path), config_path),
        inputs=inputs,
        outputs=outputs,
    )


def _tensor_specs(config: dict[str, Any], key: str, kind: str, config_path: Path) -> tuple[wire.TensorSpec, ...]:
    """`[[inputs]]` or `[[outputs]]`: a `python` model's tensors, each with a `name`, a
    `datatype` (KServe's: FP32, INT64, BYTES, ...) and the `dims` of one item (without the batch
    dimension; -1 for a variable one), as Triton's model configuration has them."""
    raw = config.get(key)
    if kind != "python":
        if raw is not None:
            source = "the ONNX graph declares them" if kind == "onnx" else f"the {kind} runner's are fixed"
            raise ConfigError(f"{config_path}: [[{key}]] is for python models ({source})")
        return ()
    if not isinstance(raw, list) or not raw or not all(isinstance(entry, dict) for entry in raw):
        raise ConfigError(f"{config_path}: a python model needs [[{key}]] tables, each with name, datatype and dims")
    specs: list[wire.TensorSpec] = []
    for number, entry in enumerate(raw, start=1):
        where = f"{config_path}: [[{key}]] number {number}"
        unknown = sorted(set(entry) - {"name", "datatype", "dims"})
        if unknown:
            raise ConfigError(f"{where} has no setting {unknown[0]!r} (it has name, datatype, dims)")
        name, datatype, dims = entry.get("name"), entry.get("datatype"), entry.get("dims", [])
        if not isinstance(name, str) or not name or any(spec.name == name for spec in specs):
            raise ConfigError(f"{where}: name must be a non-empty string, not used twice; got {name!r}")
        if datatype not in TENSOR_DATATYPES:
            raise ConfigError(f"{where} ({name}): datatype must be one of {', '.join(TENSOR_DATATYPES)}, "
                              f"got {datatype!r}")
        if not isinstance(dims, list) or not all(_is_int(d) and (d >= 1 or d == -1) for d in dims):
            raise ConfigError(f"{where} ({name}): dims must be a list of sizes (-1: variable), got {dims!r}")
        specs.append(wire.TensorSpec(name, datatype, (-1, *dims)))
    return tuple(specs)


def _merge(config: dict[str, Any], own: dict[str, Any], own_path: Path) -> dict[str, Any]:
    """A version's `version.toml` over its model's settings: its tables update the model's tables
    key by key, its other values replace them. `[routing]` is the model's, not a version's."""
    if "routing" in own:
        raise ConfigError(f"{own_path}: [routing] belongs in the model's model.toml, not a version's")
    merged = dict(config)
    for key, value in own.items():
        merged[key] = {**merged[key], **value} if isinstance(value, dict) and isinstance(merged.get(key), dict) \
            else value
    return merged


def _routing(raw: dict[str, Any], config_path: Path) -> wire.Routing | None:
    """`[routing]`: `traffic = { 1 = 90, 2 = 10 }` (weights by version) and `sticky` (default true)."""
    if not raw:
        return None
    for key in raw:
        if key not in ("traffic", "sticky"):
            raise ConfigError(f"{config_path}: [routing] has no setting {key!r} (it has traffic, sticky)")
    traffic, sticky = raw.get("traffic"), raw.get("sticky", True)
    if not isinstance(sticky, bool):
        raise ConfigError(f"{config_path}: [routing] sticky must be true or false, got {sticky!r}")
    if not isinstance(traffic, dict) or not traffic:
        raise ConfigError(f"{config_path}: [routing] traffic must be a table of version = weight, "
                          f"e.g. {{ 1 = 90, 2 = 10 }}, got {traffic!r}")
    for version, weight in traffic.items():
        if not version.isdigit():
            raise ConfigError(f"{config_path}: [routing] traffic: {version!r} is not a version number")
        if not _is_number(weight) or not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"{config_path}: [routing] traffic: version {version}'s weight must be a "
                              f"number >= 0, got {weight!r}")
    if not any(weight > 0 for weight in traffic.values()):
        raise ConfigError(f"{config_path}: [routing] traffic: at least one version needs a weight above 0")
    if not math.isfinite(sum(traffic.values())):
        raise ConfigError(f"{config_path}: [routing] traffic: the weights add up to more than a number can hold")
    return wire.Routing({version: float(weight) for version, weight in traffic.items()}, sticky)


def _loading(raw: dict[str, Any], config_path: Path) -> LoadingConfig:
    """`[loading]`: `on_demand` (default false), `idle_unload_s` (default 600 for a model loaded
    on demand, else 0: never) and `timeout_s` (`DEFAULT_LOAD_TIMEOUT_S`)."""
    for key in raw:
        if key not in ("on_demand", "idle_unload_s", "timeout_s"):
            raise ConfigError(f"{config_path}: [loading] has no setting {key!r} "
                              "(it has on_demand, idle_unload_s, timeout_s)")
    on_demand = raw.get("on_demand", False)
    if not isinstance(on_demand, bool):
        raise ConfigError(f"{config_path}: [loading] on_demand must be true or false, got {on_demand!r}")
    idle_s = raw.get("idle_unload_s", 600.0 if on_demand else 0.0)
    if not _is_number(idle_s) or not math.isfinite(idle_s) or idle_s < 0:
        raise ConfigError(f"{config_path}: [loading] idle_unload_s must be a number of seconds >= 0, got {idle_s!r}")
    timeout_s = raw.get("timeout_s", DEFAULT_LOAD_TIMEOUT_S)
    if not _is_number(timeout_s) or not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ConfigError(f"{config_path}: [loading] timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    return LoadingConfig(on_demand, float(idle_s), float(timeout_s))


def _cache_enabled(raw: dict[str, Any], kind: str, config_path: Path) -> bool:
    for key, value in raw.items():
        if key != "enabled":
            raise ConfigError(f"{config_path}: [cache] has no setting {key!r} (it has enabled)")
        if not isinstance(value, bool):
            raise ConfigError(f"{config_path}: [cache] enabled must be true or false, got {value!r}")
    return bool(raw.get("enabled", kind not in UNCACHED_KINDS))


def _revision(config: dict[str, Any], manifest_path: Path) -> str:
    """The digest behind `ModelVersion.revision`: the parsed settings and the manifest's text."""
    digest = hashlib.blake2b(json.dumps(config, sort_keys=True, default=str).encode(), digest_size=12)
    with contextlib.suppress(OSError):
        digest.update(manifest_path.read_bytes())
    return digest.hexdigest()


def _table(config: dict[str, Any], name: str, config_path: Path) -> dict[str, Any]:
    table = config.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{config_path}: [{name}] must be a table, got {table!r}")
    return dict(table)


def _batching(raw: dict[str, Any], kind: str, params: dict[str, Any], config_path: Path) -> BatchingConfig:
    concurrency = params.get("concurrency")
    if kind == "http-single" and _is_int(concurrency) and concurrency >= 1:
        raw = {"max_batch_size": concurrency, **raw}  # a batch is one round of calls
    known = BatchingConfig.__dataclass_fields__
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"{config_path}: [batching] has no setting {key!r} (it has {', '.join(known)})")
        if not _is_int(value) or value < 1:
            raise ConfigError(f"{config_path}: [batching] {key} must be a positive integer, got {value!r}")
    return BatchingConfig(**raw)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def generated_models_dir() -> Path:
    """Where generated weights go: `$SLUICE_CACHE_DIR/models`, by default `~/.cache/sluice/models`."""
    root = os.environ.get("SLUICE_CACHE_DIR") or str(Path.home() / ".cache" / "sluice")
    return Path(root) / "models"


def _weights_dir(version_dir: Path, weights: dict[str, Any], config_path: Path) -> Path:
    generated = weights.get("generate")
    if generated is not None:
        if generated != "tiny-lm":
            raise ConfigError(f"{config_path}: [weights] generate knows only 'tiny-lm', got {generated!r}")
        return generated_models_dir() / f"{generated}-{version_dir.name}"
    package = weights.get("package")
    if package is None:
        return version_dir
    try:
        spec = importlib.util.find_spec(str(package))
    except (ImportError, ValueError):  # e.g. a dotted name whose parent is not installed
        spec = None
    if spec is None or spec.origin is None:
        raise ConfigError(f"{config_path}: weights package {package!r} is not installed")
    folder = Path(spec.origin).parent / str(weights.get("subdir", ""))
    if not folder.is_dir():
        raise ConfigError(f"{config_path}: weights folder {folder} does not exist")
    return folder

"""The model repository: a folder of models, each with a `model.toml` and numbered versions.

    models/
      minilm/
        model.toml        runner kind, batching limits, SLO, where the weights are
        1/
          SHA256SUMS      "<sha256>  <path>" per weight file, checked before load

A version's weights are its own folder, or (`[weights] package = ...`) the data folder of an
installed Python package, so large files are referenced rather than copied. A version whose
manifest does not match its files is refused with the reason; the others still load.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.errors import ConfigError

MANIFEST = "SHA256SUMS"
RUNNER_KINDS = ("emulated", "embedding", "http-single", "generative", "openai-upstream")
WEIGHTLESS_KINDS = ("http-single", "openai-upstream")
"""Runner kinds that load no files: a version folder without a SHA256SUMS manifest is fine."""


@dataclass(frozen=True, slots=True)
class BatchingConfig:
    max_batch_size: int = 32
    max_batch_cost: int = 8192
    """Upper bound on a batch's padded cost: items x longest item, in elements or tokens."""
    max_queue_items: int = 4096
    """A hard cap on queued items per model, behind the work-based bound."""


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

    @property
    def key(self) -> tuple[str, str]:
        return (self.name, self.version)


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
        try:
            config = tomllib.loads(config_path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{config_path}: {exc}") from exc
        version_dirs = sorted((p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=_num)
        if not version_dirs:
            refused.append(RefusedVersion(model_dir.name, "-", "no version folders (1/, 2/, ...)"))
        for version_dir in version_dirs:
            try:
                versions.append(_parse_version(model_dir.name, version_dir, config, config_path))
            except ConfigError as exc:
                refused.append(RefusedVersion(model_dir.name, version_dir.name, exc.message))
    return Repository(root=root, versions=tuple(versions), refused=tuple(refused))


def verify(version: ModelVersion) -> None:
    """Check the version's files against its SHA256SUMS manifest; raise ConfigError on mismatch."""
    if not version.manifest_path.is_file():
        if version.kind in WEIGHTLESS_KINDS:
            return
        raise ConfigError(f"{version.name} v{version.version}: missing {MANIFEST} manifest")
    listed = parse_manifest(version.manifest_path.read_text(), version.manifest_path)
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
            if p.is_file() and p.name != MANIFEST and str(p.relative_to(version.weights_dir)) not in listed
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


def _parse_version(name: str, version_dir: Path, config: dict[str, Any], config_path: Path) -> ModelVersion:
    kind = config.get("kind")
    if kind not in RUNNER_KINDS:
        raise ConfigError(f"{config_path}: kind must be one of {', '.join(RUNNER_KINDS)}, got {kind!r}")
    batching_raw = config.get("batching", {})
    concurrency = config.get("params", {}).get("concurrency")
    if kind == "http-single" and isinstance(concurrency, int) and concurrency >= 1:
        batching_raw = {"max_batch_size": concurrency, **batching_raw}  # a batch is one round of calls
    try:
        batching = BatchingConfig(**batching_raw)
    except TypeError as exc:
        raise ConfigError(f"{config_path}: [batching]: {exc}") from exc
    if batching.max_batch_size < 1 or batching.max_batch_cost < 1 or batching.max_queue_items < 1:
        raise ConfigError(f"{config_path}: [batching] limits must be positive")
    slo_ms = config.get("slo", {}).get("default_ms", 1000)
    if not isinstance(slo_ms, int | float) or slo_ms <= 0:
        raise ConfigError(f"{config_path}: [slo] default_ms must be a positive number")
    return ModelVersion(
        name=name,
        version=version_dir.name,
        kind=kind,
        platform=str(config.get("platform", f"sluice_{kind}")),
        batching=batching,
        slo_s=float(slo_ms) / 1000.0,
        weights_dir=_weights_dir(version_dir, config.get("weights", {}), config_path),
        manifest_path=version_dir / MANIFEST,
        params=dict(config.get("params", {})),
        generator=config.get("weights", {}).get("generate"),
        upstream=dict(config.get("upstream", {})),
    )


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
    spec = importlib.util.find_spec(str(package))
    if spec is None or spec.origin is None:
        raise ConfigError(f"{config_path}: weights package {package!r} is not installed")
    folder = Path(spec.origin).parent / str(weights.get("subdir", ""))
    if not folder.is_dir():
        raise ConfigError(f"{config_path}: weights folder {folder} does not exist")
    return folder

"""Tenants: who may call, with which key, at what share of the devices and within which limits.

The tenants file (TOML) is read at start and again on SIGHUP:

    [admin]
    api_keys = ["sha256:..."]          # admin scope: /admin/* routes; not a tenant, runs no inference

    [tenants.acme]
    api_keys = ["sha256:..."]          # `sluice keys create acme` adds one and prints the key once
    weight = 2                         # share of the devices, relative to the other tenants
    priority = "interactive"           # default class: interactive | standard | batch
    requests_per_min = 600             # token bucket of requests (0: unlimited)
    tokens_per_min = 200000            # token bucket of input + output tokens (0: unlimited)
    max_concurrent = 64                # requests in flight at once (0: unlimited)
    credits_device_s = 3600            # device-seconds per credit period (0: unlimited)
    credit_period_s = 86400
    models = ["minilm", "emulated"]    # omitted: every model

    [metrics]                          # optional: who may read GET /metrics
    access = "keys"                    # "open" (the default: anyone who reaches the port) or "keys":
    api_keys = ["sha256:..."]          # these scrape-only keys, or an admin key (`sluice keys create --metrics`)

`/metrics` names every tenant and what each used. On a gateway the tenants themselves reach,
`access = "keys"` keeps that from them; Prometheus sends the key as its scrape's
`authorization` credentials. A metrics key does nothing else.

Keys are stored only as SHA-256 digests. API keys are long random tokens, so a fast digest is
enough (a password hash's stretching protects low-entropy secrets, which these are not). A
presented key is hashed, looked up, and the stored digest compared with `hmac.compare_digest`.
With no tenants file, sluice runs with one local tenant (`LOCAL`) that needs no key.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import tomllib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.errors import ConfigError, InvalidInput
from sluice.priority import Priority, parse_priority

__all__ = ["LOCAL_TENANT", "Tenant", "TenantDirectory", "hash_key", "load_tenants", "new_key", "read_tenants_text"]

KEY_PREFIX = "sk-sluice-"
HASH_PREFIX = "sha256:"


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    weight: float = 1.0
    priority: Priority = Priority.STANDARD
    requests_per_min: float = 0.0
    tokens_per_min: float = 0.0
    max_concurrent: int = 0
    credits_device_s: float = 0.0
    credit_period_s: float = 86_400.0
    models: frozenset[str] | None = None
    """Models this tenant may use; None: all."""
    key_hashes: tuple[str, ...] = ()

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


LOCAL_TENANT = Tenant(name="")
"""The single tenant of a server started without a tenants file."""


@dataclass(frozen=True, slots=True)
class TenantDirectory:
    """An immutable snapshot of the tenants file; a reload builds a new one."""

    tenants: Mapping[str, Tenant]
    admin_hashes: frozenset[str] = frozenset()
    path: Path | None = None
    metrics_hashes: frozenset[str] | None = None
    """Keys that may read `/metrics` besides the admin's; None: anyone may."""
    _by_hash: Mapping[str, Tenant] = field(default_factory=dict)

    @property
    def is_open(self) -> bool:
        """No tenants file: every request is the local tenant's, and no key is asked for."""
        return self.path is None

    def tenant_for_key(self, key: str) -> Tenant | None:
        digest = hash_key(key)
        tenant = self._by_hash.get(digest)
        if tenant is None:
            return None
        # the lookup found the entry; confirm it without a data-dependent early exit
        return tenant if any(hmac.compare_digest(digest, h) for h in tenant.key_hashes) else None

    def is_admin_key(self, key: str) -> bool:
        return _is_listed(key, self.admin_hashes)

    def is_metrics_key(self, key: str) -> bool:
        """A `[metrics]` key: it reads `/metrics` (and the model statistics) and nothing else."""
        return self.metrics_hashes is not None and _is_listed(key, self.metrics_hashes)

    def may_scrape(self, key: str | None) -> bool:
        """Whether a request presenting `key` may read `/metrics`."""
        if self.metrics_hashes is None:
            return True
        return bool(key) and _is_listed(key or "", self.metrics_hashes | self.admin_hashes)

    @classmethod
    def open(cls) -> TenantDirectory:
        return cls(tenants={LOCAL_TENANT.name: LOCAL_TENANT})

    @classmethod
    def build(cls, tenants: Mapping[str, Tenant], admin_hashes: frozenset[str], path: Path,
              metrics_hashes: frozenset[str] | None = None) -> TenantDirectory:
        by_hash: dict[str, Tenant] = {}
        for tenant in tenants.values():
            for digest in tenant.key_hashes:
                if digest in by_hash or digest in admin_hashes or digest in (metrics_hashes or ()):
                    raise ConfigError(f"{path}: the same API key is listed twice (tenant {tenant.name!r})")
                by_hash[digest] = tenant
        if metrics_hashes and metrics_hashes & admin_hashes:
            raise ConfigError(f"{path}: a key is listed both in [admin] and in [metrics]")
        return cls(tenants=dict(tenants), admin_hashes=admin_hashes, path=path, metrics_hashes=metrics_hashes,
                   _by_hash=by_hash)


def _is_listed(key: str, hashes: frozenset[str]) -> bool:
    """Whether `key`'s digest is one of `hashes`, compared in constant time."""
    digest = hash_key(key)
    return any(hmac.compare_digest(digest, h) for h in hashes)


def new_key() -> str:
    """A fresh API key: 256 random bits, URL-safe."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return HASH_PREFIX + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def read_tenants_text(path: Path) -> str:
    """The tenants file's text, or a `ConfigError` naming the file when it cannot be read or is
    not UTF-8 (shared with `keyfile`, which parses it keeping its layout)."""
    try:
        return path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read tenants file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text: {exc.reason} at byte {exc.start}") from exc


def load_tenants(path: Path, known_models: Collection[str] | None = None) -> TenantDirectory:
    """The tenants file at `path`, or a `ConfigError` naming the file, the tenant and the field
    that is wrong. `known_models`: the models a tenant's `models` may name (the repository's);
    None: any (a gateway in front of workers started elsewhere does not know them)."""
    text = read_tenants_text(path)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
    unknown = set(raw) - {"admin", "metrics", "tenants"}
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {sorted(unknown)}; expected [admin], [metrics] and "
                          "[tenants.NAME]")
    admin = _table(raw.get("admin", {}), f"{path}: [admin]")
    if set(admin) - {"api_keys"}:  # a misspelt `api_keys` would leave the admin locked out, saying nothing
        raise ConfigError(f"{path}: [admin]: unknown field(s) {sorted(set(admin) - {'api_keys'})}; expected api_keys")
    admin_hashes = frozenset(_key_hashes(admin.get("api_keys", []), f"{path}: [admin] api_keys"))
    metrics_hashes = _metrics_keys(_table(raw.get("metrics", {}), f"{path}: [metrics]"), f"{path}: [metrics]")
    tenants_raw = _table(raw.get("tenants", {}), f"{path}: [tenants]")
    tenants = {name: _tenant(name, _table(body, f"{path}: [tenants.{name}]"), path)
               for name, body in tenants_raw.items()}
    if not tenants:
        raise ConfigError(f"{path} defines no tenants; add a [tenants.NAME] table")
    if known_models is not None:
        _check_models(tenants.values(), known_models, path)
    return TenantDirectory.build(tenants, admin_hashes, path, metrics_hashes)


def _metrics_keys(table: dict[str, Any], where: str) -> frozenset[str] | None:
    """`[metrics]`: None when `/metrics` is open, else the scrape keys' digests."""
    unknown = set(table) - {"access", "api_keys"}
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}; expected access and api_keys")
    access = table.get("access", "keys" if "api_keys" in table else "open")
    if access not in ("open", "keys"):
        raise ConfigError(f"{where}: access must be \"open\" or \"keys\", got {access!r}")
    hashes = frozenset(_key_hashes(table.get("api_keys", []), f"{where} api_keys"))
    if access == "open" and hashes:
        raise ConfigError(f"{where}: api_keys are listed but access is \"open\"")
    return None if access == "open" else hashes


_TENANT_FIELDS = {"api_keys", "weight", "priority", "requests_per_min", "tokens_per_min", "max_concurrent",
                  "credits_device_s", "credit_period_s", "models"}


def _tenant(name: str, body: dict[str, Any], path: Path) -> Tenant:
    where = f"{path}: [tenants.{name}]"
    if not name or not name.replace("-", "").replace("_", "").replace(".", "").isalnum() or len(name) > 64:
        raise ConfigError(f"{where}: a tenant name is 1-64 letters, digits, '-', '_' or '.'")
    unknown = set(body) - _TENANT_FIELDS
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}")
    try:
        parsed = parse_priority(body.get("priority", "standard"), "priority")
    except InvalidInput as exc:
        raise ConfigError(f"{where}: {exc.message}") from None
    models = body.get("models")
    if models is not None and not (isinstance(models, list) and all(isinstance(m, str) for m in models)):
        raise ConfigError(f"{where}: models must be a list of model names")
    return Tenant(
        name=name,
        weight=_weight(body, where),
        priority=Priority.STANDARD if parsed is None else parsed,
        requests_per_min=_number(body, "requests_per_min", 0.0, where),
        tokens_per_min=_number(body, "tokens_per_min", 0.0, where),
        max_concurrent=int(_number(body, "max_concurrent", 0, where, integer=True)),
        credits_device_s=_number(body, "credits_device_s", 0.0, where),
        credit_period_s=_number(body, "credit_period_s", 86_400.0, where, minimum=1.0),
        models=None if models is None else frozenset(models),
        key_hashes=tuple(_key_hashes(body.get("api_keys", []), f"{where} api_keys")),
    )


def _weight(body: dict[str, Any], where: str) -> float:
    """A share of the devices: a finite number above 0 (a tenant of weight 0 would never be served)."""
    weight = body.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight <= 0:
        raise ConfigError(f"{where}: weight must be a number > 0 (a share of the devices relative to the other "
                          f"tenants'), got {weight!r}")
    return float(weight)


def _check_models(tenants: Iterable[Tenant], known_models: Collection[str], path: Path) -> None:
    """A tenant's `models` naming a model the repository does not have is a mistake (a misspelt
    name would leave the tenant refused the model it was meant to use, with a 403 that does not
    say why)."""
    for tenant in tenants:
        unknown = sorted((tenant.models or frozenset()) - set(known_models))
        if unknown:
            raise ConfigError(f"{path}: [tenants.{tenant.name}] models: the model repository has no model "
                              f"{', '.join(map(repr, unknown))} (it has {', '.join(sorted(known_models)) or 'none'})")


def _table(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a table")
    return value


def _number(body: dict[str, Any], key: str, default: float, where: str, minimum: float = 0.0,
            integer: bool = False) -> float:
    """A finite number >= `minimum` (TOML also has inf and nan: a limit of either would fail every
    request the limit is checked on); with `integer`, a whole one."""
    value = body.get(key, default)
    kind = "a whole number" if integer else "a number"
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            or value < minimum or (integer and value != int(value))):
        unlimited = " (0: unlimited)" if minimum == 0 else ""
        raise ConfigError(f"{where}: {key} must be {kind} >= {minimum:g}{unlimited}, got {value!r}")
    return float(value)


def _key_hashes(values: Any, where: str) -> list[str]:
    if not isinstance(values, list):
        raise ConfigError(f"{where} must be a list")
    hashes = []
    for value in values:
        if not (isinstance(value, str) and value.startswith(HASH_PREFIX) and len(value) == len(HASH_PREFIX) + 64
                and all(c in "0123456789abcdefABCDEF" for c in value[len(HASH_PREFIX):])):
            shown = f" ({value[:len(HASH_PREFIX) + 8]}...)" if isinstance(value, str) and value.startswith(
                HASH_PREFIX) else ""
            raise ConfigError(f"{where}: keys are stored as 'sha256:<64 hex digits>'{shown} "
                              "(use `sluice keys create`), never in plain text")
        hashes.append(value.lower())
    return hashes

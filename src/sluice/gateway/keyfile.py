"""`sluice keys create|list|revoke`: a tenants file's keys, changed keeping its comments and layout.

The key is generated here, its SHA-256 digest written to the file, and the key itself returned to
be printed once; sluice never stores it. The file is checked with the server's own loader before
it is replaced (atomically), so a running server's SIGHUP never reads a half-written file. Two
`sluice keys create` at once take turns (a lock on the file's folder, held from reading the file
to replacing it): each adds its key to what the other wrote, so no key printed is lost.

A key is revoked by the key itself or by its stored hash (`sluice keys list` shows the start of
each: enough to tell them apart), which is all an operator has of a key that was not theirs.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomlkit
from tomlkit.exceptions import TOMLKitError

from sluice.errors import ConfigError
from sluice.gateway.tenants import HASH_PREFIX, hash_key, load_tenants, new_key, read_tenants_text

__all__ = ["StoredKey", "add_key", "list_keys", "revoke_key"]

_MIN_PREFIX_HEX = 8
"""The fewest hex digits of a hash that `revoke_key` takes as its start (what `list_keys` shows is longer)."""


@dataclass(frozen=True, slots=True)
class StoredKey:
    owner: str
    """`tenant NAME`, `admin` or `metrics`: the table that lists it."""
    digest: str
    """As stored: `sha256:<64 hex digits>`."""


def add_key(path: Path, tenant: str | None, *, metrics: bool = False) -> str:
    """Create a key for `tenant` (None: an admin key, or with `metrics` a key that may only read
    `/metrics`, which then needs one), adding the tenant if it is new."""
    path = _target(path)
    with _locked(path):
        _check_writable(path)
        document = _read(path)
        key = new_key()
        _add_hash(document, tenant, metrics, hash_key(key))
        text = tomlkit.dumps(document)
        _replace(path, text if text.endswith("\n") else text + "\n", needs_tenant=tenant is not None)
    return key


def list_keys(path: Path) -> list[StoredKey]:
    """Every key hash in the tenants file, by the table that lists it ([admin], [metrics], then
    each tenant in the file's order)."""
    if not path.exists():
        raise ConfigError(f"cannot read tenants file {path}: No such file or directory")
    return [StoredKey(owner, str(digest)) for owner, keys in _key_lists(_read(path)) for digest in keys]


def revoke_key(path: Path, key_or_hash: str) -> StoredKey:
    """Take a key out of the tenants file: given as the key itself, or as its stored hash or the
    start of it (`sha256:` and at least 8 hex digits, naming one key only). Returns what it was;
    `ConfigError` if the file lists no such key. The server stops taking it at its next reload."""
    path = _target(path)
    if not path.exists():
        raise ConfigError(f"cannot read tenants file {path}: No such file or directory")
    wanted = key_or_hash.strip()
    is_hash = wanted.lower().startswith(HASH_PREFIX)
    if is_hash and (len(wanted) < len(HASH_PREFIX) + _MIN_PREFIX_HEX or len(wanted) > len(HASH_PREFIX) + 64):
        raise ConfigError(f"{wanted!r}: give the key, or its hash as `sluice keys list` shows it "
                          f"({HASH_PREFIX} and at least {_MIN_PREFIX_HEX} hex digits)")
    with _locked(path):
        _check_writable(path)
        document = _read(path)
        target = wanted.lower() if is_hash else hash_key(wanted)
        found = [(owner, keys, index) for owner, keys in _key_lists(document)
                 for index, digest in enumerate(keys)
                 if (str(digest).lower().startswith(target) if is_hash else str(digest).lower() == target)]
        if not found:
            what = f"key hash {wanted!r}" if is_hash else "such key"
            raise ConfigError(f"{path} lists no {what} (`sluice keys list --tenants {path}` shows them)")
        if len(found) > 1:
            raise ConfigError(f"{wanted!r} is the start of {len(found)} key hashes in {path}: give more of it")
        owner, keys, index = found[0]
        revoked = StoredKey(owner, str(keys[index]))
        del keys[index]
        text = tomlkit.dumps(document)
        _replace(path, text if text.endswith("\n") else text + "\n", needs_tenant=True)
    return revoked


def _key_lists(document: tomlkit.TOMLDocument) -> Iterator[tuple[str, Any]]:
    """Each table's `api_keys` array, with who it belongs to."""
    for section in ("admin", "metrics"):
        table = document.get(section)
        if isinstance(table, dict) and isinstance(table.get("api_keys"), list):
            yield section, table["api_keys"]
    tenants = document.get("tenants")
    if isinstance(tenants, dict):
        for name, table in tenants.items():
            if isinstance(table, dict) and isinstance(table.get("api_keys"), list):
                yield f"tenant {name}", table["api_keys"]


def _check_writable(path: Path) -> None:
    """Refuse to change a file nobody may write (mode 0444): it is replaced, not written, so its
    folder's permissions alone would let the change through, against what its mode says."""
    with contextlib.suppress(OSError):  # no file yet: one is created
        mode = stat.S_IMODE(path.stat().st_mode)
        if not mode & 0o222:
            raise ConfigError(f"tenants file {path} is read-only (mode {mode:04o}): make it writable to change "
                              "its keys")


def _read(path: Path) -> tomlkit.TOMLDocument:
    """The tenants file as a document that keeps its layout (a new one if there is no file yet)."""
    if not path.exists():
        return tomlkit.document()
    text = read_tenants_text(path)
    try:
        return tomlkit.parse(text)
    except TOMLKitError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc


def _add_hash(document: tomlkit.TOMLDocument, tenant: str | None, metrics: bool, digest: str) -> None:
    if metrics:
        table = document.setdefault("metrics", tomlkit.table())
        table.setdefault("access", "keys")
    elif tenant is None:
        table = document.setdefault("admin", tomlkit.table())
    else:
        tenants = document.setdefault("tenants", tomlkit.table(is_super_table=True))
        table = tenants.setdefault(tenant, tomlkit.table())
    keys = table.setdefault("api_keys", tomlkit.array())
    keys.append(digest)


def _target(path: Path) -> Path:
    """The file to change: a link's target (replacing the link with a file would leave the file
    the server reads, where it points, without the change)."""
    return path.resolve() if path.is_symlink() else path


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path`'s folder while the file is read, changed and replaced (not on
    the file itself: replacing it makes a new file, and a writer waiting on the old one's lock
    would then change what it read before, losing the other's key)."""
    try:
        fd = os.open(path.parent.resolve(), os.O_RDONLY)
    except OSError as exc:
        raise ConfigError(f"cannot write tenants file {path}: {exc.strerror}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _replace(path: Path, text: str, needs_tenant: bool) -> None:
    """Write `text` to `path` through a file beside it, renamed over it: keeping `path`'s
    permissions (a temporary file is created readable by its owner alone, which would lock out a
    server that runs as another user and reads the file on SIGHUP)."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent.resolve(), prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise ConfigError(f"cannot write tenants file {path}: {exc.strerror}") from exc
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        if path.exists():
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        if needs_tenant:
            try:  # refuse to write a file the server would not load
                load_tenants(Path(tmp))
            except ConfigError as exc:
                raise ConfigError(exc.message.replace(tmp, str(path))) from None
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)

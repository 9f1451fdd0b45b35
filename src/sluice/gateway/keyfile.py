"""`sluice keys create`: add a key's hash to a tenants file, keeping the file's comments and layout.

The key is generated here, its SHA-256 digest written to the file, and the key itself returned to
be printed once; sluice never stores it. The file is checked with the server's own loader before
it is replaced (atomically), so a running server's SIGHUP never reads a half-written file. Two
`sluice keys create` at once take turns (a lock on the file's folder, held from reading the file
to replacing it): each adds its key to what the other wrote, so no key printed is lost.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import tomlkit
from tomlkit.exceptions import TOMLKitError

from sluice.errors import ConfigError
from sluice.gateway.tenants import hash_key, load_tenants, new_key

__all__ = ["add_key"]


def add_key(path: Path, tenant: str | None, *, metrics: bool = False) -> str:
    """Create a key for `tenant` (None: an admin key, or with `metrics` a key that may only read
    `/metrics`, which then needs one), adding the tenant if it is new."""
    with _locked(path):
        document = _read(path)
        key = new_key()
        _add_hash(document, tenant, metrics, hash_key(key))
        text = tomlkit.dumps(document)
        _replace(path, text if text.endswith("\n") else text + "\n", needs_tenant=tenant is not None)
    return key


def _read(path: Path) -> tomlkit.TOMLDocument:
    """The tenants file as a document that keeps its layout (a new one if there is no file yet)."""
    if not path.exists():
        return tomlkit.document()
    try:
        return tomlkit.parse(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read tenants file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text: {exc.reason} at byte {exc.start}") from exc
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

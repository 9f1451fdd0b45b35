"""`sluice keys create`: add a key's hash to a tenants file, keeping the file's comments and layout.

The key is generated here, its SHA-256 digest written to the file, and the key itself returned to
be printed once; sluice never stores it. The file is checked with the server's own loader before
it is replaced (atomically), so a running server's SIGHUP never reads a half-written file.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import tomlkit
from tomlkit.exceptions import TOMLKitError

from sluice.errors import ConfigError
from sluice.gateway.tenants import hash_key, load_tenants, new_key

__all__ = ["add_key"]


def add_key(path: Path, tenant: str | None, *, metrics: bool = False) -> str:
    """Create a key for `tenant` (None: an admin key, or with `metrics` a key that may only read
    `/metrics`, which then needs one), adding the tenant if it is new."""
    try:
        document = tomlkit.parse(path.read_text()) if path.exists() else tomlkit.document()
    except TOMLKitError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
    key = new_key()
    if metrics:
        table = document.setdefault("metrics", tomlkit.table())
        table.setdefault("access", "keys")
    elif tenant is None:
        table = document.setdefault("admin", tomlkit.table())
    else:
        tenants = document.setdefault("tenants", tomlkit.table(is_super_table=True))
        table = tenants.setdefault(tenant, tomlkit.table())
    keys = table.setdefault("api_keys", tomlkit.array())
    keys.append(hash_key(key))
    text = tomlkit.dumps(document)
    _replace(path, text if text.endswith("\n") else text + "\n", needs_tenant=tenant is not None)
    return key


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

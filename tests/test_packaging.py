"""Every third-party package that sluice's source imports is declared, with a version range, in
pyproject.toml (the issue asks for version ranges for every dependency)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import sluice

PACKAGE = Path(sluice.__file__).parent
PYPROJECT = PACKAGE.parents[1] / "pyproject.toml"


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported_roots() -> set[str]:
    roots: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                roots.add(node.module.split(".")[0])
    return {root for root in roots if root not in sys.stdlib_module_names and root not in ("sluice", "__future__")}


def _declared() -> dict[str, str]:
    """Distribution name -> its requirement; an extra `pkg[a,b]` also declares `pkg-a` and `pkg-b`."""
    declared: dict[str, str] = {}
    for requirement in tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]:
        match = re.match(r"([A-Za-z0-9_.-]+)(?:\[([^\]]*)\])?", requirement)
        assert match is not None, requirement
        name = _normal(match.group(1))
        declared[name] = requirement
        for extra in filter(None, (match.group(2) or "").split(",")):
            declared[f"{name}-{_normal(extra)}"] = requirement
    return declared


def test_every_imported_package_is_declared_with_a_version_range():
    declared = _declared()
    distributions = packages_distributions()
    for root in sorted(_imported_roots()):
        names = [_normal(d) for d in distributions.get(root, [root])]
        found = [declared[name] for name in names if name in declared]
        assert found, f"sluice imports {root!r} (from {names}) but pyproject.toml does not declare it"
        assert all(re.search(r"[<>=]=?|~=", requirement) for requirement in found), found

"""Dependency direction (STYLE.md rule 10), checked on the source's import statements.

- pure policy (scheduler, router, clock, errors) imports nothing that does I/O;
- only the worker and the engines import torch / transformers;
- only the api package imports the web framework;
- nothing imports a layer later on the request's path backwards (worker never imports gateway/api).
"""

from __future__ import annotations

import ast
from pathlib import Path

import sluice

PACKAGE = Path(sluice.__file__).parent
IO_MODULES = {"asyncio", "socket", "zmq", "aiohttp", "httpx", "starlette", "uvicorn", "subprocess", "torch",
              "transformers", "sqlite3", "prometheus_client", "os", "requests"}
PURE = ["scheduler", "gateway/router.py", "gateway/traffic.py", "gateway/shadow.py", "gateway/limits.py", "clock.py",
        "errors.py",
        "priority.py", "circuit.py",
        "engines/generative/block_manager.py", "engines/generative/scheduler.py", "engines/generative/sequence.py",
        "engines/generative/config.py"]


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _modules(*relative: str) -> list[Path]:
    paths: list[Path] = []
    for rel in relative:
        target = PACKAGE / rel
        paths += sorted(target.rglob("*.py")) if target.is_dir() else [target]
    return paths


def _roots(names: set[str]) -> set[str]:
    return {name.split(".")[0] for name in names}


def test_pure_policy_imports_no_io():
    for path in _modules(*PURE):
        bad = _roots(_imports(path)) & IO_MODULES
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def test_only_worker_and_engines_import_torch():
    allowed = {PACKAGE / "worker", PACKAGE / "engines"}
    for path in PACKAGE.rglob("*.py"):
        if any(parent in allowed for parent in path.parents):
            continue
        bad = _roots(_imports(path)) & {"torch", "transformers", "tokenizers", "safetensors"}
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def test_only_api_imports_the_web_framework():
    for path in PACKAGE.rglob("*.py"):
        if PACKAGE / "api" in path.parents or path.name == "serve.py":
            continue  # serve.py assembles the app and runs uvicorn
        bad = _roots(_imports(path)) & {"starlette"}
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def test_worker_side_never_imports_gateway_or_api():
    for path in _modules("worker", "engines", "scheduler"):
        bad = {m for m in _imports(path) if m.startswith(("sluice.gateway", "sluice.api", "sluice.serve"))}
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def test_public_api_is_listed():
    assert set(sluice.__all__) == {"SluiceError", "__version__"}
    for name in sluice.__all__:
        assert hasattr(sluice, name)

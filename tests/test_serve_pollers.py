"""`sluice serve --poll-repository`: a look at the repository that fails (a folder removed while it
was walked, a volume remounting) or a reload that raises does not end the polling; the change is
acted on at a later look."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace

import sluice.serve as serve


class _Gateway:
    def __init__(self, fail_first: bool) -> None:
        self.unloaded: set[str] = set()
        self.synced: list[str] = []
        self._fail_first = fail_first

    async def sync_model(self, name: str) -> SimpleNamespace:
        self.synced.append(name)
        if self._fail_first and len(self.synced) == 1:
            raise RuntimeError("a bug while loading")
        return SimpleNamespace(versions=["1"], refused=[])


async def _poll_until(gateway: _Gateway, count: int) -> None:
    poller = asyncio.create_task(serve._poll_repository(Path("/repo"), 0.01, gateway))  # type: ignore[arg-type]
    try:
        async with asyncio.timeout(5):
            while len(gateway.synced) < count:
                assert not poller.done(), f"the poller ended on its own: {poller.exception()!r}"
                await asyncio.sleep(0.01)
        assert not poller.done(), "the poller ended on its own"
    finally:
        poller.cancel()


async def test_a_look_that_cannot_read_the_repository_is_skipped(monkeypatch, caplog):
    looks = iter([{"a": 1}, OSError("No such file or directory"), {"a": 2}])

    def fingerprints(root: Path) -> dict[str, int]:
        look = next(looks, {"a": 2})
        if isinstance(look, Exception):
            raise look
        return look

    monkeypatch.setattr(serve, "fingerprints", fingerprints)
    gateway = _Gateway(fail_first=False)
    with caplog.at_level(logging.WARNING, logger="sluice"):
        await _poll_until(gateway, 1)
    assert gateway.synced == ["a"]
    assert "model repository /repo not read this time: No such file or directory" in caplog.text


async def test_a_load_that_raises_is_logged_and_tried_again(monkeypatch, caplog):
    looks = iter([{"a": 1}])
    monkeypatch.setattr(serve, "fingerprints", lambda root: next(looks, {"a": 2}))
    gateway = _Gateway(fail_first=True)
    with caplog.at_level(logging.WARNING, logger="sluice"):
        await _poll_until(gateway, 2)
    assert gateway.synced[:2] == ["a", "a"]
    assert "loading it again failed" in caplog.text and "RuntimeError: a bug while loading" in caplog.text

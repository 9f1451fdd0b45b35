"""The sender's keep-alive client against a real loopback server that answers, rejects, closes or stalls."""

from __future__ import annotations

import asyncio
import time

import pytest

from sluice.bench.http_client import HttpPool, keep_alive_timeout_s, post_head, post_request, split_url
from sluice.bench.stats import TRANSPORT_ERROR
from tests.bench.conftest import SLOW_S, ScriptedServer
from tests.conftest import free_port


class Outcomes:
    """Every callback the pool makes, by request index, with when it came."""

    def __init__(self) -> None:
        self.by_index: dict[int, tuple[int, bool]] = {}
        self.done_s: dict[int, float] = {}
        self.num_calls = 0

    def on_done(self, index: int, status: int, has_retry_after: bool) -> None:
        self.num_calls += 1
        self.by_index[index] = (status, has_retry_after)
        self.done_s[index] = time.perf_counter()

    async def wait_for(self, count: int, timeout_s: float = 5.0) -> None:
        deadline_s = time.perf_counter() + timeout_s
        while self.num_calls < count:
            assert time.perf_counter() < deadline_s, f"only {self.num_calls} of {count} requests finished"
            await asyncio.sleep(0.005)


async def _send_all(url: str, count: int, max_connections: int = 0, timeout_s: float = 5.0,
                    ) -> tuple[Outcomes, int]:
    """Send `count` requests to `url` at once; returns the outcomes and the pool's peak connections."""
    outcomes = Outcomes()
    origin, _ = split_url(url)
    head = post_head(url, {"Content-Type": "application/json"})
    async with HttpPool(origin, outcomes.on_done, max_connections, timeout_s) as pool:
        for index in range(count):
            pool.send(index, post_request(head, b'{"n":%d}' % index), time.perf_counter())
        await outcomes.wait_for(count, timeout_s + 2.0)
        await asyncio.sleep(0.05)  # any second callback for a request would show up now
        peak = pool.peak_connections
    assert outcomes.num_calls == count and sorted(outcomes.by_index) == list(range(count))
    return outcomes, peak


@pytest.mark.parametrize(("path", "expected"), [("/ok", (200, False)), ("/busy", (503, True)),
                                                ("/reject", (429, False))])
async def test_status_and_retry_after_are_recorded(scripted_server: ScriptedServer, path: str,
                                                   expected: tuple[int, bool]) -> None:
    outcomes, _ = await _send_all(scripted_server.url(path), 40)
    assert set(outcomes.by_index.values()) == {expected}
    assert scripted_server.num_requests == 40


async def test_keep_alive_connections_are_reused(scripted_server: ScriptedServer) -> None:
    outcomes = Outcomes()
    url = scripted_server.url("/ok")
    origin, _ = split_url(url)
    head = post_head(url, {})
    async with HttpPool(origin, outcomes.on_done, 0, 5.0) as pool:
        for index in range(50):
            pool.send(index, post_request(head, b"{}"), time.perf_counter())
            await outcomes.wait_for(index + 1)
        assert pool.num_connections == 1
    assert scripted_server.num_accepted == 1


async def test_a_connection_the_server_closes_is_not_reused(scripted_server: ScriptedServer) -> None:
    outcomes, _ = await _send_all(scripted_server.url("/close"), 30, max_connections=2)
    assert set(outcomes.by_index.values()) == {(200, False)}
    assert scripted_server.num_accepted == 30


async def test_the_connection_cap_holds_and_waiting_requests_go_in_order(scripted_server: ScriptedServer) -> None:
    outcomes, peak = await _send_all(scripted_server.url("/slow"), 24, max_connections=4)
    assert set(outcomes.by_index.values()) == {(200, False)}
    assert peak == 4 and scripted_server.peak_open == 4
    # 24 requests over 4 connections that each take SLOW_S: six rounds, first in first out.
    finish_order = sorted(outcomes.done_s, key=outcomes.done_s.__getitem__)
    rounds = [sorted(finish_order[i:i + 4]) for i in range(0, 24, 4)]
    assert rounds == [list(range(i, i + 4)) for i in range(0, 24, 4)]
    assert max(outcomes.done_s.values()) - min(outcomes.done_s.values()) >= 5 * SLOW_S * 0.9


async def test_a_request_past_its_timeout_is_an_error_and_its_connection_closed(
        scripted_server: ScriptedServer) -> None:
    timeout_s = 0.3
    started_s = time.perf_counter()
    outcomes, _ = await _send_all(scripted_server.url("/stall"), 5, max_connections=2, timeout_s=timeout_s)
    assert set(outcomes.by_index.values()) == {(TRANSPORT_ERROR, False)}
    # Waiting for a connection counts towards the timeout: all five fail about together.
    waited_s = [done_s - started_s for done_s in outcomes.done_s.values()]
    assert min(waited_s) >= timeout_s and max(waited_s) < timeout_s + 0.5
    await asyncio.sleep(0.05)
    assert scripted_server.num_open == 0


@pytest.mark.parametrize("path", ["/drop", "/garbage"])
async def test_a_connection_lost_or_broken_mid_request_is_an_error(scripted_server: ScriptedServer,
                                                                   path: str) -> None:
    outcomes, _ = await _send_all(scripted_server.url(path), 10, max_connections=3)
    assert set(outcomes.by_index.values()) == {(TRANSPORT_ERROR, False)}


async def test_a_refused_connection_is_an_error_for_each_request() -> None:
    outcomes, _ = await _send_all(f"http://127.0.0.1:{free_port()}/ok", 10, max_connections=3)
    assert set(outcomes.by_index.values()) == {(TRANSPORT_ERROR, False)}


def test_request_bytes_carry_host_headers_and_length() -> None:
    head = post_head("http://example.test:8000/v2/models/m/infer?x=1", {"X-Api-Key": "k", "Host": "ignored"})
    request = post_request(head, b'{"a":1}')
    assert request == (b"POST /v2/models/m/infer?x=1 HTTP/1.1\r\nHost: example.test:8000\r\nX-Api-Key: k\r\n"
                       b'Content-Length: 7\r\n\r\n{"a":1}')


@pytest.mark.parametrize("headers", [{"X-Bad": "a\r\nInjected: 1"}, {"X-Bad\n": "a"}])
def test_headers_with_line_breaks_are_rejected(headers: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="line breaks"):
        post_head("http://127.0.0.1:1/", headers)


@pytest.mark.parametrize("url", ["ftp://host/x", "http:///nohost", "127.0.0.1:8000/x"])
def test_only_http_urls_with_a_host_are_accepted(url: str) -> None:
    with pytest.raises(ValueError, match="http"):
        split_url(url)


async def test_a_connection_is_kept_as_long_as_the_server_says_it_keeps_it(scripted_server: ScriptedServer) -> None:
    """`Keep-Alive: timeout=3` on the answers: an idle connection stays open (until 1 s before
    the server's limit) past the pool's own idle timeout, and the next request reuses it
    instead of opening another."""
    outcomes = Outcomes()
    url = scripted_server.url("/lasting")
    origin, _ = split_url(url)
    head = post_head(url, {})
    async with HttpPool(origin, outcomes.on_done, 0, 5.0, idle_timeout_s=0.2) as pool:
        pool.send(0, post_request(head, b"{}"), time.perf_counter())
        await outcomes.wait_for(1)
        await asyncio.sleep(0.6)  # three times the pool's own idle timeout
        assert pool.num_connections == 1
        pool.send(1, post_request(head, b"{}"), time.perf_counter())
        await outcomes.wait_for(2)
        idle_since = time.monotonic()
        while pool.num_connections:  # and closed 1 s before the server's 3 s
            assert time.monotonic() - idle_since < 3.0, "kept past the server's keep-alive timeout"
            await asyncio.sleep(0.01)
        assert time.monotonic() - idle_since >= 1.5
    assert scripted_server.num_accepted == 1


def test_the_keep_alive_timeout_is_read_from_the_header() -> None:
    assert keep_alive_timeout_s(b"timeout=75") == 75.0
    assert keep_alive_timeout_s(b"max=100, Timeout= 5") == 5.0
    assert keep_alive_timeout_s(b"max=100") is None
    assert keep_alive_timeout_s(b"timeout=soon") is None


def test_pool_arguments_are_validated() -> None:
    origin, _ = split_url("http://127.0.0.1:1/")
    with pytest.raises(ValueError, match="max_connections"):
        HttpPool(origin, lambda *_: None, -1, 1.0)
    with pytest.raises(ValueError, match="timeout"):
        HttpPool(origin, lambda *_: None, 1, 0.0)


async def test_an_idle_connection_is_closed_before_the_servers_keep_alive_runs_out(
        scripted_server: ScriptedServer) -> None:
    """A connection idle past `idle_timeout_s` is closed by the pool, so a later request opens a
    fresh one instead of racing the server's own close of the old one."""
    outcomes = Outcomes()
    url = scripted_server.url("/ok")
    origin, _ = split_url(url)
    head = post_head(url, {})
    async with HttpPool(origin, outcomes.on_done, 0, 5.0, idle_timeout_s=0.2) as pool:
        pool.send(0, post_request(head, b"{}"), time.perf_counter())
        await outcomes.wait_for(1)
        pool.send(1, post_request(head, b"{}"), time.perf_counter())  # within the idle timeout: reused
        await outcomes.wait_for(2)
        assert scripted_server.num_accepted == 1
        deadline = time.monotonic() + 5.0
        while pool.num_connections or scripted_server.num_open:  # closed once idle for 0.2 s
            assert time.monotonic() < deadline, "the idle connection was never closed"
            await asyncio.sleep(0.01)
        pool.send(2, post_request(head, b"{}"), time.perf_counter())
        await outcomes.wait_for(3)
    assert scripted_server.num_accepted == 2
    assert [outcomes.by_index[i] for i in range(3)] == [(200, False)] * 3

"""The gateway-worker link: frames, identities, reconnection, refusing what is not connected."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from sluice import transport
from sluice.transport import Address, Channel, Listener
from tests.conftest import until


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Echo:
    """A listener that answers every frame with b"re:" + frame, to the peer that sent it."""

    def __init__(self) -> None:
        self.received: list[tuple[bytes, bytes]] = []
        self.listener: Listener | None = None

    async def start(self, address: str) -> _Echo:
        self.listener = await Listener.start(address, self._on_frame)
        return self

    def _on_frame(self, identity: bytes, frame: bytes) -> None:
        self.received.append((identity, frame))
        assert self.listener is not None
        self.listener.send(identity, b"re:" + frame)


def test_address_forms() -> None:
    assert Address.parse("ipc:///tmp/w.sock") == Address(path="/tmp/w.sock")
    assert Address.parse("tcp://10.0.0.5:7000") == Address(host="10.0.0.5", port=7000)
    assert Address.parse("tcp://*:7000") == Address(host="0.0.0.0", port=7000)
    assert Address.parse("tcp://[::1]:7000") == Address(host="::1", port=7000)
    for bad in ("", "w.sock", "ipc://", "tcp://host", "tcp://host:0", "tcp://host:99999", "http://h:1"):
        with pytest.raises(ValueError):
            Address.parse(bad)


@pytest.mark.parametrize("kind", ["ipc", "tcp"])
async def test_frames_reach_the_peer_that_sent_them(tmp_path: Path, kind: str) -> None:
    address = f"ipc://{tmp_path}/w.sock" if kind == "ipc" else f"tcp://127.0.0.1:{_free_port()}"
    echo = await _Echo().start(address)
    answers: dict[str, list[bytes]] = {"a": [], "b": []}
    channels = {name: Channel(address, name.encode(), answers[name].append) for name in answers}
    for channel in channels.values():
        channel.start()
    await until(lambda: all(c.is_connected for c in channels.values()))
    big = bytes(range(256)) * 20_000  # 5 MB: arrives in many reads
    for i in range(200):  # many small frames: several arrive in one read
        assert channels["a"].send(b"%d" % i)
    assert channels["b"].send(big)
    assert channels["b"].send(b"")
    await until(lambda: len(answers["a"]) == 200 and len(answers["b"]) == 2)
    assert answers["a"] == [b"re:%d" % i for i in range(200)]
    assert answers["b"] == [b"re:" + big, b"re:"]
    assert {identity for identity, _ in echo.received} == {b"a", b"b"}
    for channel in channels.values():
        await channel.aclose()
    assert echo.listener is not None
    await echo.listener.aclose()


async def test_send_fails_while_not_connected_and_the_channel_reconnects(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/w.sock"
    answers: list[bytes] = []
    connects: list[int] = []
    channel = Channel(address, b"gw", answers.append, on_connect=lambda: connects.append(1))
    channel.start()
    await asyncio.sleep(0.1)
    assert not channel.is_connected
    assert channel.send(b"nobody listens") is False  # refused at once, not queued for later

    echo = await _Echo().start(address)
    await until(lambda: channel.is_connected)
    assert channel.send(b"one")
    await until(lambda: answers == [b"re:one"])

    assert echo.listener is not None
    await echo.listener.aclose()  # the worker goes away...
    await until(lambda: not channel.is_connected)
    assert channel.send(b"lost") is False
    echo = await _Echo().start(address)  # ...and a new one takes its address
    await until(lambda: channel.is_connected)
    assert channel.send(b"two")
    await until(lambda: answers == [b"re:one", b"re:two"])
    assert len(connects) == 2
    assert echo.received == [(b"gw", b"two")]  # the identity came first again, not as a frame
    await channel.aclose()
    assert echo.listener is not None
    await echo.listener.aclose()


async def test_a_reconnected_peer_gets_the_answers_by_its_identity(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/w.sock"
    received: list[tuple[bytes, bytes]] = []
    listener = await Listener.start(address, lambda identity, frame: received.append((identity, frame)))
    first: list[bytes] = []
    channel = Channel(address, b"gw", first.append)
    channel.start()
    await until(lambda: channel.is_connected)
    channel.send(b"asked before")
    await until(lambda: len(received) == 1)
    await channel.aclose()
    await until(lambda: not listener.send(b"gw", b"x"))  # the old link is gone: nothing to route to
    second: list[bytes] = []
    again = Channel(address, b"gw", second.append)
    again.start()
    await until(lambda: listener.send(b"gw", b"answer"))  # once it has introduced itself
    await until(lambda: second == [b"answer"])
    assert first == []
    assert listener.send(b"nobody", b"x") is False
    await again.aclose()
    await listener.aclose()


async def test_a_corrupt_stream_is_dropped_and_others_keep_working(tmp_path: Path) -> None:
    path = tmp_path / "w.sock"
    echo = await _Echo().start(f"ipc://{path}")
    answers: list[bytes] = []
    good = Channel(f"ipc://{path}", b"good", answers.append)
    good.start()
    await until(lambda: good.is_connected)

    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write((2).to_bytes(4, "big") + b"me")
    writer.write((transport.MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # the listener hung up on it
    writer.close()

    assert good.send(b"still here")
    await until(lambda: answers == [b"re:still here"])
    await good.aclose()
    assert echo.listener is not None
    await echo.listener.aclose()


async def test_a_unix_socket_another_listener_holds_is_not_taken_over(tmp_path: Path) -> None:
    """Two workers given one ipc:// address: the second used to unlink the first's socket file and
    listen in its place, leaving the first running but unreachable. It is refused instead; a
    socket file left by a process that died is still taken."""
    address = f"ipc://{tmp_path}/w.sock"
    first = await Listener.start(address, lambda identity, frame: None)
    with pytest.raises(OSError, match="another process is listening there"):
        await Listener.start(address, lambda identity, frame: None)
    answers: list[bytes] = []
    channel = Channel(address, b"gw", answers.append)
    channel.start()
    await until(lambda: first.send(b"gw", b"still reachable"))
    await until(lambda: answers == [b"still reachable"])
    await channel.aclose()
    await first.aclose()

    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # bound, never listening, then gone
    stale.bind(f"{tmp_path}/stale.sock")
    stale.close()
    again = await Listener.start(f"ipc://{tmp_path}/stale.sock", lambda identity, frame: None)
    await again.aclose()


async def test_a_peer_that_cannot_be_reached_for_long_is_logged_once(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """`sluice gateway --worker` with a wrong address (or one whose worker is gone) retried in
    silence: nothing in the gateway's log said why the worker never became ready."""
    monkeypatch.setattr(transport, "UNREACHABLE_LOG_S", 0.3, raising=False)
    address = f"tcp://127.0.0.1:{_free_port()}"  # nothing listens there
    channel = Channel(address, b"gw", lambda frame: None)
    with caplog.at_level("WARNING", logger="sluice.transport"):
        channel.start()
        await until(lambda: any(address in r.getMessage() for r in caplog.records), timeout_s=5.0)
        await asyncio.sleep(1.5)  # still failing: not logged again
    await channel.aclose()
    messages = [r.getMessage() for r in caplog.records if address in r.getMessage()]
    assert len(messages) == 1 and messages[0].startswith(f"cannot connect to {address} for "), messages

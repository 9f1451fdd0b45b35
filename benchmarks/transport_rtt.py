"""Round trip of one small message between two processes: pyzmq's asyncio DEALER/ROUTER over ipc
(what sluice used between gateway and worker) against `sluice.transport` over a Unix socket.

    python benchmarks/transport_rtt.py            # back to back, then with 5 ms idle gaps
    (needs `pip install pyzmq` for the ZeroMQ half; sluice itself no longer depends on it)

Both sides run uvloop, as `sluice serve` does. Reports p50/p99 of the round trip and the client
process's CPU per round trip.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import sys
import tempfile
import time

import uvloop

from sluice.transport import Channel, Listener

ROUND_TRIPS = 3000
MESSAGE = b"x" * 100


def _zmq_echo(address: str) -> None:
    import zmq
    import zmq.asyncio

    async def main() -> None:
        router = zmq.asyncio.Context().socket(zmq.ROUTER)
        router.bind(address)
        while True:
            await router.send_multipart(await router.recv_multipart())

    uvloop.run(main())


def _sluice_echo(address: str) -> None:
    async def main() -> None:
        listener: Listener | None = None

        def echo(identity: bytes, frame: bytes) -> None:
            assert listener is not None
            listener.send(identity, frame)

        listener = await Listener.start(address, echo)
        await asyncio.Event().wait()

    uvloop.run(main())


async def _zmq_client(address: str, gap_s: float) -> tuple[list[float], float]:
    import zmq
    import zmq.asyncio

    dealer = zmq.asyncio.Context().socket(zmq.DEALER)
    dealer.connect(address)
    await asyncio.sleep(0.3)
    latencies, cpu_start = [], time.process_time()
    for _ in range(ROUND_TRIPS):
        start = time.perf_counter()
        await dealer.send(MESSAGE)
        await dealer.recv()
        latencies.append(time.perf_counter() - start)
        if gap_s:
            await asyncio.sleep(gap_s)
    return latencies, time.process_time() - cpu_start


async def _sluice_client(address: str, gap_s: float) -> tuple[list[float], float]:
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[bytes] = loop.create_future()

    def on_frame(frame: bytes) -> None:
        answer.set_result(frame)

    channel = Channel(address, b"bench", on_frame)
    channel.start()
    while not channel.is_connected:
        await asyncio.sleep(0.01)
    latencies, cpu_start = [], time.process_time()
    for _ in range(ROUND_TRIPS):
        answer = loop.create_future()
        start = time.perf_counter()
        channel.send(MESSAGE)
        await answer
        latencies.append(time.perf_counter() - start)
        if gap_s:
            await asyncio.sleep(gap_s)
    cpu_s = time.process_time() - cpu_start
    await channel.aclose()
    return latencies, cpu_s


def _report(name: str, gap_s: float, latencies: list[float], cpu_s: float) -> None:
    ordered = sorted(latencies)
    p50, p99 = ordered[len(ordered) // 2], ordered[int(len(ordered) * 0.99)]
    print(f"{name:8} gap {gap_s * 1000:3.0f} ms: p50 {p50 * 1e6:5.0f} µs  p99 {p99 * 1e6:6.0f} µs  "
          f"client CPU {cpu_s / len(latencies) * 1e6:4.0f} µs per round trip")


def main() -> None:
    folder = tempfile.mkdtemp(prefix="sluice-rtt-")
    servers = [("sluice", _sluice_echo, f"ipc://{folder}/sluice.sock", _sluice_client)]
    try:
        import zmq  # noqa: F401

        servers.insert(0, ("zeromq", _zmq_echo, f"ipc://{folder}/zmq.sock", _zmq_client))
    except ImportError:
        print("pyzmq is not installed: measuring sluice.transport only", file=sys.stderr)
    for name, serve, address, client in servers:
        server = multiprocessing.Process(target=serve, args=(address,), daemon=True)
        server.start()
        time.sleep(0.5)
        for gap_s in (0.0, 0.005):
            _report(name, gap_s, *uvloop.run(client(address, gap_s)))
        server.terminate()


if __name__ == "__main__":
    main()

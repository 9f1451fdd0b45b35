"""What holding `DEVICE_GATE` shared costs an engine step or a batch: the median of enter + exit,
alone and with other threads holding it shared in a loop (as several models' steps would).

    python benchmarks/generative/gate_cost.py [--rounds 7] [--threads 3]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import timeit

from sluice.engines.device_gate import DEVICE_GATE


def _hold_once() -> None:
    with DEVICE_GATE.shared():
        pass


def _per_hold_us(number: int, rounds: int) -> float:
    return statistics.median(timeit.repeat(_hold_once, number=number, repeat=rounds)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=3, help="other threads holding it shared in a loop")
    args = parser.parse_args()
    print(f"alone: {_per_hold_us(50_000, args.rounds):.2f} us per step")
    stop = threading.Event()

    def others() -> None:
        while not stop.is_set():
            _hold_once()

    threads = [threading.Thread(target=others, daemon=True) for _ in range(args.threads)]
    for thread in threads:
        thread.start()
    try:
        print(f"with {args.threads} threads holding it in a loop: {_per_hold_us(5_000, args.rounds):.2f} us per step")
    finally:
        stop.set()
        for thread in threads:
            thread.join()


if __name__ == "__main__":
    main()

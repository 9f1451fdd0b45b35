"""What compressing a KServe infer answer costs (`api.compression`), with no I/O: a 4 KiB and a
1 MiB JSON answer (FP32 outputs) and a 1 MiB binary one (FP32, and INT64 token ids), each
compressed at zlib level 1 (what sluice uses) and 6 (zlib's default), gzip and deflate; and
`compress_response` for a client that does not ask (the checks alone).

    python benchmarks/response_compression.py [--rounds 7]

Prints, per body and setting, the compressed size and the median (and least) CPU time per
compression over the rounds (process time: the shared host's other processes count less).
"""

from __future__ import annotations

import argparse
import statistics
import time
import zlib
from collections.abc import Callable

import msgspec
import numpy as np
from starlette.responses import Response

from sluice.api.compression import CODINGS, compress_response


def _json_answer(num_values: int, size: int) -> bytes:
    values = np.random.default_rng(0).standard_normal(num_values).astype(np.float32).tolist()
    body = msgspec.json.encode({"model_name": "m", "model_version": "1",
                                "outputs": [{"name": "y", "datatype": "FP32", "shape": [num_values], "data": values}]})
    return body[:size]


def _bodies() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    return {
        "4 KiB JSON": _json_answer(300, 4096),
        "1 MiB JSON": _json_answer(80_000, 1 << 20),
        "1 MiB binary FP32": rng.standard_normal(1 << 18).astype(np.float32).tobytes(),
        "1 MiB binary INT64 ids": rng.integers(0, 30_000, 1 << 17).astype(np.int64).tobytes(),
    }


def _time(run: Callable[[], object], repeats: int, rounds: int) -> tuple[float, float]:
    """Median and least over `rounds` of the CPU seconds per call, each round `repeats` calls."""
    per_call = []
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(repeats):
            run()
        per_call.append((time.process_time() - started) / repeats)
    return statistics.median(per_call), min(per_call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    rounds = parser.parse_args().rounds
    for name, body in _bodies().items():
        repeats = 2000 if len(body) < 65536 else 5
        for level in (1, 6):
            for coding, wbits in CODINGS.items():
                def run(level: int = level, wbits: int = wbits, body: bytes = body) -> bytes:
                    compressor = zlib.compressobj(level, zlib.DEFLATED, wbits)
                    return compressor.compress(body) + compressor.flush()

                median, least = _time(run, repeats, rounds)
                size = len(run())
                print(f"{name:23} {len(body):8d} B  {coding:7} level {level}: {size:8d} B ({size / len(body):4.0%})"
                      f"  {median * 1e6:9.1f} µs ({least * 1e6:.1f})")

    json_body = _bodies()["4 KiB JSON"]

    def unasked() -> object:  # the coroutine driven by hand, as an await that does not suspend runs it
        try:
            compress_response(Response(json_body, media_type="application/json"), None).send(None)
        except StopIteration as done:
            return done.value
        raise AssertionError("compress_response suspended")

    def plain() -> Response:
        return Response(json_body, media_type="application/json")

    with_checks, _ = _time(unasked, 20_000, rounds)
    without, _ = _time(plain, 20_000, rounds)
    print(f"4 KiB JSON, client does not ask: compress_response adds {(with_checks - without) * 1e6:.2f} µs")

if __name__ == "__main__":
    main()

"""How long the gateway takes to parse large KServe JSON infer bodies (`api.tensors.parse_request`).

    PYTHONPATH=src python benchmarks/json_tensors.py [--repeat 5]

Bodies: 1M FP32 values in one input; the same beside a one-element BYTES input (the general
path); 150,528 FP32 values (a 224x224x3 image). Prints the best of `--repeat` parses of each, in ms.
"""

from __future__ import annotations

import argparse
import json
import time

from sluice.api.tensors import parse_request


def _body(*inputs: dict[str, object]) -> bytes:
    return json.dumps({"inputs": list(inputs)}).encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    million = {"name": "x", "shape": [1, 1_000_000], "datatype": "FP32", "data": [0.5] * 1_000_000}
    image = {"name": "x", "shape": [1, 224, 224, 3], "datatype": "FP32", "data": [0.25] * 150_528}
    text = {"name": "t", "shape": [1], "datatype": "BYTES", "data": ["hi"]}
    bodies = {"1M FP32": _body(million), "1M FP32 + BYTES": _body(million, text), "150,528 FP32": _body(image)}
    for name, body in bodies.items():
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            parse_request(body, None)
            times.append(time.perf_counter() - start)
        print(f"{name:16} {len(body) / 1e6:5.1f} MB  best {min(times) * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()

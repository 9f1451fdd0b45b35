"""Triton's classification extension: an output asked for with `"classification": k` in its
parameters (`tritonclient`'s `InferRequestedOutput(name, class_count=k)`) comes back as its top k
classes instead of its values, on HTTP and gRPC alike.

    output FP32 [2, 3]  [[0.1, 0.7, 0.2],       classification 2 ->  BYTES [2, 2]
                         [0.5, 0.1, 0.4]]                             [["0.700000:1", "0.200000:2"],
                                                                       ["0.500000:0", "0.400000:2"]]

Each class is `"<value>:<index>"` as Triton writes it (the value as C++'s `std::to_string`:
six decimals for floating point), highest value first (equal values: the lower index first),
per row of a batched model (one whose first dimension is the batch: `max_batch_size` > 0),
else over the whole tensor; at most k, fewer where a row holds fewer elements. sluice has no
label files, so no `:<label>` follows. A count that is not a positive integer, or one asked of a
BOOL or BYTES output, is refused (400) before any inference is run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from sluice import wire
from sluice.api.tensors import Tensor
from sluice.errors import InvalidInput

PARAMETER = "classification"


def class_counts(info: wire.ModelInfo, requested: Iterable[tuple[str, Any]]) -> dict[str, int]:
    """The outputs asked for as classes, and how many of each: from each requested output's name
    and its `classification` parameter (None: not asked). The names are the model's (`check_outputs`)."""
    datatypes = {spec.name: spec.datatype for spec in info.outputs}
    counts = {}
    for name, count in requested:
        if count is None:
            continue
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InvalidInput(f"output {name!r}: parameter 'classification' must be a positive integer (the number "
                               f"of classes), got {count!r}", param=PARAMETER)
        if datatypes.get(name) in ("BOOL", "BYTES"):
            raise InvalidInput(f"output {name!r} is {datatypes[name]}: classification needs a numeric output",
                               param=PARAMETER)
        counts[name] = count
    return counts


def top_classes(tensor: Tensor, count: int, is_batched: bool) -> Tensor:
    """`tensor`'s top `count` classes per row (`is_batched`) or over all of it, as a BYTES tensor
    of shape `[rows, k]` (batched) or `[k]`."""
    values = tensor.values
    if tensor.datatype == "BF16" and isinstance(values, np.ndarray):
        values = values.astype(np.float32)  # exactly the same values, of a dtype numpy sorts as floats
    if not isinstance(values, np.ndarray) or tensor.datatype == "BOOL":
        raise InvalidInput(f"output {tensor.name!r} is {tensor.datatype}: classification needs a numeric output",
                           param=PARAMETER)
    is_batched = is_batched and values.ndim > 0
    num_rows = values.shape[0] if is_batched else 1
    per_row = math.prod(values.shape[1:]) if is_batched else values.size
    rows = values.reshape(num_rows, per_row)
    k = min(count, per_row)
    is_float = values.dtype.kind == "f"
    classes: list[bytes] = []
    for row in rows:
        # highest first, equal values in index order: a stable ascending sort of the reversed row, reversed
        order = (per_row - 1 - np.argsort(row[::-1], kind="stable")[::-1])[:k]
        classes += [(f"{float(row[i]):f}" if is_float else str(int(row[i]))).encode() + b":%d" % i for i in order]
    shape = (num_rows, k) if is_batched else (k,)
    return Tensor(tensor.name, "BYTES", shape, classes)

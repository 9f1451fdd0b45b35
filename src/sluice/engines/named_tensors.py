"""What the runners of a user's own model share (`onnx`, `python`): named input and output
tensors, and batching by rows.

A request's tensors share their first dimension: each row across them is one item, queued and
batched on its own, so rows of many requests run together. A batch is split into groups of
items whose rows have the same shapes, each group one call of the model with the rows stacked
(a model sees tensors, not ragged lists). Inputs named in `[params.pad]` are padded instead:
rows that differ only in their variable dimensions run in one call, padded with the given value
to the longest (a transformer's `input_ids = 0` and `attention_mask = 0`), and an output's
variable dimension as long as the padded length (per-token logits) is cut back to each row's
own length. The model answers each output with one row per item; a request's answer stacks its
items' rows again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from sluice import wire
from sluice.engines.base import ItemFailure, PreparedItem
from sluice.errors import ConfigError, InvalidInput
from sluice.repository import ModelVersion

WARMUP_BATCHES = (1, 4, 16)
WARMUP_REPEATS = 3

Row = tuple[np.ndarray, ...]
"""One item: its row of each input (or output), in the model's declared order."""


class NamedTensorRunner:
    """Subclasses load the model, set `info` (`named_io_info`), call `read_padding` and implement
    `infer`."""

    info: wire.ModelInfo
    one_row_per_call = False
    """The model takes one row at a time (an ONNX graph exported with batch dimension 1)."""
    _pad: dict[int, Any] = {}  # (read_padding sets each runner's own)
    """Input position -> the value its rows are padded with; empty: nothing is padded."""

    def read_padding(self, version: ModelVersion) -> None:
        """`[params.pad]`: input name = pad value (a number; a string for a BYTES input), for
        inputs with a variable dimension besides the batch's."""
        raw = version.params.get("pad", {})
        where = f"{version.name} v{version.version}: [params.pad]"
        if not isinstance(raw, dict):
            raise ConfigError(f"{where} must be a table of input name = pad value, got {raw!r}")
        positions = {spec.name: i for i, spec in enumerate(self.info.inputs)}
        pad = {}
        for name, value in raw.items():
            if name not in positions:
                raise ConfigError(f"{where}: the model has no input {name!r} (it has {', '.join(positions)})")
            spec = self.info.inputs[positions[name]]
            if -1 not in spec.shape[1:]:
                raise ConfigError(f"{where}: input {name!r} has no variable dimension to pad ({list(spec.shape)})")
            is_text = spec.datatype == "BYTES"
            if isinstance(value, bool) or not isinstance(value, str if is_text else int | float):
                raise ConfigError(f"{where}: {name} must be {'a string' if is_text else 'a number'}, got {value!r}")
            pad[positions[name]] = value.encode() if isinstance(value, str) else value
        self._pad = pad

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        """Run the model on stacked rows (each input's first dimension the items); return each
        output with as many rows. Called from the device thread only."""
        raise NotImplementedError

    def prior(self) -> tuple[float, float, float]:
        return 0.002, 0.000001, 1.0  # refined by warm-up, then by every batch

    def warmup(self) -> list[tuple[int, float]]:
        return []

    def prepare(self, payload: wire.Payload) -> list[PreparedItem]:
        if not isinstance(payload, wire.TensorsPayload):
            raise InvalidInput(f"model {self.info.name!r} takes named tensors "
                               f"({', '.join(spec.name for spec in self.info.inputs)})")
        arrays = [_array(tensor) for tensor in payload.tensors]
        order = {spec.name: i for i, spec in enumerate(self.info.inputs)}
        arrays = [arrays[i] for i in sorted(range(len(arrays)), key=lambda i: order[payload.tensors[i].name])]
        cost = max(1, *(int(np.prod(array.shape[1:], dtype=np.int64)) for array in arrays))
        return [PreparedItem(cost=cost, data=tuple(array[row, ...] for array in arrays))
                for row in range(arrays[0].shape[0])]

    def run_batch(self, items: Sequence[PreparedItem]) -> list[Any | ItemFailure]:
        groups: dict[tuple[tuple[int, ...] | int, ...], list[int]] = {}
        for index, item in enumerate(items):  # padded inputs group by rank, the others by shape
            key = tuple(row.ndim if i in self._pad else row.shape for i, row in enumerate(item.data))
            groups.setdefault((index, *key) if self.one_row_per_call else key, []).append(index)
        outputs: list[Row | ItemFailure] = [ItemFailure("not run")] * len(items)
        for indices in groups.values():
            for index, row in zip(indices, self._run_group([items[i].data for i in indices]), strict=True):
                outputs[index] = row
        return outputs

    def pack(self, outputs: Sequence[Row]) -> wire.Payload:
        tensors = []
        for position, spec in enumerate(self.info.outputs):
            rows = [output[position] for output in outputs]
            if not rows:  # a request of no rows: each output empty, its fixed dimensions kept
                tensors.append(wire.NamedTensor(spec.name, spec.datatype, (0, *(max(d, 0) for d in spec.shape[1:])),
                                                b""))
                continue
            if any(row.shape != rows[0].shape for row in rows):
                shapes = sorted({str(list(row.shape)) for row in rows})
                raise ValueError(f"output {spec.name!r} has rows of different shapes ({', '.join(shapes)}) "
                                 "within one request")
            stacked = np.stack(rows)
            tensors.append(wire.NamedTensor(spec.name, spec.datatype, stacked.shape, _bytes(stacked, spec.datatype)))
        return wire.TensorsPayload(tensors)

    def close(self) -> None:
        pass

    def timed_warmup(self, make_row: Row) -> list[tuple[int, float]]:
        """Time batches of `make_row` repeated (sizes `WARMUP_BATCHES` up to the model's max
        batch); the first, untimed call absorbs one-off start-up costs."""
        cost = max(1, *(int(np.prod(row.shape, dtype=np.int64)) for row in make_row))
        self._run_group([make_row])
        observations = []
        for size in WARMUP_BATCHES:
            if size > self.info.max_batch_size:
                break
            for _ in range(WARMUP_REPEATS):
                started = time.perf_counter()
                self._run_group([make_row] * size)
                observations.append((size * cost, time.perf_counter() - started))
        return observations

    def _run_group(self, rows: list[Row]) -> list[Row]:
        """Items whose rows have the same shapes (but for padded inputs), as one call of the model."""
        inputs = {spec.name: self._stack([row[i] for row in rows], i) for i, spec in enumerate(self.info.inputs)}
        answered = self.infer(inputs)
        if not isinstance(answered, dict):
            raise TypeError(f"the model returned {type(answered).__name__}, not a dict of output name -> array")
        columns = []
        for spec in self.info.outputs:
            if spec.name not in answered:
                raise KeyError(f"the model gave no output {spec.name!r} (it gave {', '.join(map(repr, answered))})")
            column = _as_declared(answered[spec.name], spec)
            if column.ndim == 0 or column.shape[0] != len(rows):
                raise ValueError(f"output {spec.name!r} has shape {list(column.shape)}: its first dimension "
                                 f"must be the batch's {len(rows)} items")
            columns.append(column)
        answers = [tuple(column[i, ...] for column in columns) for i in range(len(rows))]
        return self._unpad(rows, answers) if self._pad else answers

    def _stack(self, rows: list[np.ndarray], position: int) -> np.ndarray:
        if position not in self._pad or all(row.shape == rows[0].shape for row in rows):
            return np.stack(rows)
        longest = np.max([row.shape for row in rows], axis=0)
        value = self._pad[position]
        return np.stack([np.pad(row, [(0, int(n) - d) for d, n in zip(row.shape, longest, strict=True)],
                                constant_values=value) for row in rows])

    def _unpad(self, rows: list[Row], answers: list[Row]) -> list[Row]:
        """Each output's variable dimensions as long as the padded length (the first padded
        input's first variable dimension) cut back to the row's own length."""
        first = min(self._pad)
        axis = self.info.inputs[first].shape[1:].index(-1)
        lengths = [row[first].shape[axis] for row in rows]
        padded = max(lengths)
        trimmed = []
        for length, answer in zip(lengths, answers, strict=True):
            if length == padded:
                trimmed.append(answer)
                continue
            cut = []
            for spec, value in zip(self.info.outputs, answer, strict=True):
                index = tuple(slice(0, length) if declared == -1 and size == padded else slice(None)
                              for declared, size in zip(spec.shape[1:], value.shape, strict=False))
                cut.append(value[index])
            trimmed.append(tuple(cut))
        return trimmed


def named_io_info(version: ModelVersion, inputs: Sequence[wire.TensorSpec],
                  outputs: Sequence[wire.TensorSpec]) -> wire.ModelInfo:
    return wire.ModelInfo(
        name=version.name,
        version=version.version,
        kind=version.kind,
        platform=version.platform,
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        max_batch_size=version.batching.max_batch_size,
        max_batch_cost=version.batching.max_batch_cost,
        slo_s=version.slo_s,
        accepts_text=False,
        accepts_tensor=True,
        cache_revision=version.cache_revision,
        named_io=True,
    )


def zeros_row(specs: Sequence[wire.TensorSpec]) -> Row:
    """One item of zeros (empty strings for BYTES), each variable dimension 1: for warm-up."""
    row = []
    for spec in specs:
        shape = tuple(1 if d < 0 else d for d in spec.shape[1:])
        row.append(np.full(shape, b"", dtype=object) if spec.datatype == "BYTES"
                   else np.zeros(shape, dtype=wire.DATATYPES[spec.datatype]))
    return tuple(row)


def _array(tensor: wire.NamedTensor) -> np.ndarray:
    if tensor.datatype == "BYTES":
        values = wire.decode_bytes_elements(tensor.data)
        array = np.empty(len(values), dtype=object)
        array[:] = values
        return array.reshape(tensor.shape)
    return np.frombuffer(tensor.data, dtype=wire.DATATYPES[tensor.datatype].newbyteorder("<")).reshape(tensor.shape)


def _as_declared(value: Any, spec: wire.TensorSpec) -> np.ndarray:
    """A model's output as an array of its declared datatype (BYTES: `bytes` elements, `str`
    encoded as UTF-8)."""
    if spec.datatype != "BYTES":
        array = np.asarray(value)
        is_float = spec.datatype in wire.FLOAT_DATATYPES
        kind = "f" if array.dtype == wire.DATATYPES["BF16"] else array.dtype.kind  # (bfloat16's own kind is "V")
        if kind not in "biuf" or (kind == "f" and not is_float):
            raise TypeError(f"output {spec.name!r} is {array.dtype}, which is not {spec.datatype}")
        return array.astype(wire.DATATYPES[spec.datatype], copy=False)
    array = np.asarray(value, dtype=object)
    flat = array.reshape(-1)
    for i, element in enumerate(flat):
        if isinstance(element, str):
            flat[i] = element.encode()
        elif not isinstance(element, bytes):
            raise TypeError(f"output {spec.name!r} (BYTES) holds {type(element).__name__}, not bytes or str")
    return array


def _bytes(array: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        return wire.encode_bytes_elements(list(array.reshape(-1)))
    return np.ascontiguousarray(array, dtype=wire.DATATYPES[datatype].newbyteorder("<")).tobytes()

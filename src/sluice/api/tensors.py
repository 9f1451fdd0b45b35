"""KServe v2 tensors: JSON and the binary tensor data extension, to and from numpy / wire payloads.

Binary extension (Triton's `extension_binary_data`): the body is a JSON header of
`Inference-Header-Content-Length` bytes followed by raw tensor bytes; each binary input names
its size in `parameters.binary_data_size`, in input order. BYTES elements are each a 4-byte
little-endian length followed by the bytes.

    | JSON header (N bytes) | input 0 raw bytes | input 1 raw bytes | ...
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from sluice.api.common import unreadable_json
from sluice.errors import InvalidInput

DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
NUMPY_TO_KSERVE = {str(v): k for k, v in DATATYPES.items()}
MAX_ELEMENTS = 16 * 1024 * 1024
MAX_DIMS = 16
# The Python type each JSON element must have: no strings for numbers, no numbers for BOOL.
_JSON_ELEMENT: dict[str, type] = {
    name: bool if name == "BOOL" else float if name.startswith("FP") else int for name in DATATYPES
}


class RequestedOutput(msgspec.Struct):
    name: str
    parameters: dict[str, Any] = {}


class InputTensor(msgspec.Struct):
    name: str
    shape: list[int]
    datatype: str
    data: Any = None
    parameters: dict[str, Any] = {}


class InferRequestBody(msgspec.Struct):
    inputs: list[InputTensor]
    id: str | None = None
    parameters: dict[str, Any] = {}
    outputs: list[RequestedOutput] | None = None


@dataclass(frozen=True, slots=True)
class Tensor:
    """A decoded input: a numpy array for numeric types, a list of bytes for BYTES."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    values: np.ndarray | list[bytes]


def parse_request(body: bytes, header_length: int | None) -> tuple[InferRequestBody, list[Tensor]]:
    if header_length is None:
        header, binary = body, b""
    else:
        if not 0 <= header_length <= len(body):
            raise InvalidInput("Inference-Header-Content-Length is larger than the body")
        header, binary = body[:header_length], body[header_length:]
    try:
        request = msgspec.json.decode(header, type=InferRequestBody)
    except msgspec.ValidationError as exc:
        raise InvalidInput(f"invalid inference request: {exc}") from exc
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
        raise unreadable_json(exc) from exc
    if not request.inputs:
        raise InvalidInput("inference request has no inputs", param="inputs")
    tensors = []
    offset = 0
    for tensor in request.inputs:
        size = tensor.parameters.get("binary_data_size")
        if size is not None:
            if not _is_count(size) or offset + size > len(binary):
                raise InvalidInput(f"input {tensor.name!r}: binary_data_size does not match the body")
            tensors.append(tensor_from_raw(tensor, binary[offset : offset + size]))
            offset += size
        else:
            tensors.append(_from_json(tensor))
    if offset != len(binary):
        raise InvalidInput("binary tensor data is longer than the inputs' binary_data_size")
    return request, tensors


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_shape(tensor: InputTensor) -> int:
    """The number of elements `tensor.shape` holds, refusing shapes no input could fill.

    Every dimension is bounded on its own too, so `[0, 2**62]` (zero elements) is refused
    before numpy is asked to build it.
    """
    if tensor.datatype not in DATATYPES and tensor.datatype != "BYTES":
        raise InvalidInput(f"input {tensor.name!r}: unknown datatype {tensor.datatype!r}")
    if not tensor.shape or not all(_is_count(d) for d in tensor.shape):
        raise InvalidInput(f"input {tensor.name!r}: shape must be a list of non-negative integers, "
                           f"got {tensor.shape}")
    if len(tensor.shape) > MAX_DIMS:
        raise InvalidInput(f"input {tensor.name!r}: shape has {len(tensor.shape)} dimensions, at most "
                           f"{MAX_DIMS} are allowed")
    count = 1
    for dim in tensor.shape:
        count *= dim
        if count > MAX_ELEMENTS or dim > MAX_ELEMENTS:
            raise InvalidInput(f"input {tensor.name!r}: shape {tensor.shape} holds more than {MAX_ELEMENTS} "
                               "elements")
    return count


def _from_json(tensor: InputTensor) -> Tensor:
    count = _check_shape(tensor)
    if tensor.data is None:
        raise InvalidInput(f"input {tensor.name!r} has no data")
    if tensor.datatype == "BYTES":
        flat = _flatten(tensor.data)
        if len(flat) != count or not all(isinstance(v, str) for v in flat):
            raise InvalidInput(f"input {tensor.name!r}: expected {count} strings for shape {tensor.shape}")
        return Tensor(tensor.name, "BYTES", tuple(tensor.shape), [v.encode() for v in flat])
    array = _numeric_array(tensor)
    if array.size != count:
        raise InvalidInput(f"input {tensor.name!r}: {array.size} values do not fill shape {tensor.shape}")
    return Tensor(tensor.name, tensor.datatype, tuple(tensor.shape), array.reshape(tensor.shape))


def _numeric_array(tensor: InputTensor) -> np.ndarray:
    """JSON `data` (flat or nested, row-major) as an array, checking every element's JSON type
    first: numpy alone would turn `"1.5"` or `true` into a number."""
    data = tensor.data if isinstance(tensor.data, list) else [tensor.data]
    kind: Any = _JSON_ELEMENT[tensor.datatype]
    probe = data
    num_levels = 1
    while probe and isinstance(probe[0], list):  # nested: one list level per dimension seen
        num_levels += 1
        if num_levels > MAX_DIMS:  # refused before a type as deep as the data is built
            raise InvalidInput(f"input {tensor.name!r}: data is nested more than {MAX_DIMS} levels deep")
        kind = list[kind]
        probe = probe[0]
    try:
        checked = msgspec.convert(data, list[kind])
    except msgspec.ValidationError as exc:
        where = str(exc).replace("`$", "`data", 1)
        raise InvalidInput(f"input {tensor.name!r}: data is not a {tensor.datatype} array: {where}") from exc
    try:
        with np.errstate(over="ignore"):
            array = np.asarray(checked, dtype=DATATYPES[tensor.datatype])
    except (ValueError, OverflowError) as exc:
        raise InvalidInput(f"input {tensor.name!r}: data is not a {tensor.datatype} array: {exc}") from exc
    if array.dtype.kind == "f" and np.isinf(array).any():  # JSON has no inf: a finite value overflowed
        raise InvalidInput(f"input {tensor.name!r}: a value is out of range for {tensor.datatype}")
    return array


def tensor_from_values(tensor: InputTensor, values: list[Any]) -> Tensor:
    """An input given as a flat list of already typed elements (gRPC's `contents`): Python
    numbers of the datatype's kind, or bytes for BYTES."""
    count = _check_shape(tensor)
    if len(values) != count:
        raise InvalidInput(f"input {tensor.name!r}: {len(values)} values do not fill shape {tensor.shape}")
    if tensor.datatype == "BYTES":
        return Tensor(tensor.name, "BYTES", tuple(tensor.shape), list(values))
    try:
        array = np.array(values, dtype=DATATYPES[tensor.datatype])
    except (ValueError, OverflowError) as exc:
        raise InvalidInput(f"input {tensor.name!r}: a value is out of range for {tensor.datatype}: {exc}") from exc
    return Tensor(tensor.name, tensor.datatype, tuple(tensor.shape), array.reshape(tensor.shape))


def tensor_from_raw(tensor: InputTensor, raw: bytes) -> Tensor:
    """An input given as raw little-endian bytes (the binary extension's, gRPC's `raw_input_contents`)."""
    count = _check_shape(tensor)
    if tensor.datatype == "BYTES":
        values = decode_bytes_elements(raw)
        if len(values) != count:
            raise InvalidInput(f"input {tensor.name!r}: {len(values)} BYTES elements do not fill "
                               f"shape {tensor.shape}")
        return Tensor(tensor.name, "BYTES", tuple(tensor.shape), values)
    dtype = DATATYPES[tensor.datatype]
    if len(raw) != count * dtype.itemsize:
        raise InvalidInput(f"input {tensor.name!r}: {len(raw)} bytes do not match shape {tensor.shape}")
    array = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).reshape(tensor.shape)
    return Tensor(tensor.name, tensor.datatype, tuple(tensor.shape), array)


def decode_bytes_elements(raw: bytes) -> list[bytes]:
    values = []
    offset = 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise InvalidInput("truncated BYTES element length")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise InvalidInput("truncated BYTES element")
        values.append(raw[offset : offset + length])
        offset += length
    return values


def encode_bytes_elements(values: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def _flatten(data: Any) -> list[Any]:
    if not isinstance(data, list):
        return [data]
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                stack.append(iter(value))
                break
            flat.append(value)
        else:
            stack.pop()
    return flat


def render_outputs(
    outputs: list[tuple[str, str, np.ndarray]], binary_names: set[str]
) -> tuple[list[dict[str, Any]], bytes]:
    """JSON output entries, and the raw bytes of the outputs asked for in binary (in order)."""
    entries = []
    raw_parts = []
    for name, datatype, array in outputs:
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if name in binary_names:
            raw = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            raw_parts.append(raw)
        else:
            entry["data"] = array.reshape(-1).tolist()
        entries.append(entry)
    return entries, b"".join(raw_parts)

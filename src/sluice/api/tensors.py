"""KServe v2 tensors: JSON and the binary tensor data extension, to and from numpy / wire payloads.

Binary extension (Triton's `extension_binary_data`): the body is a JSON header of
`Inference-Header-Content-Length` bytes followed by raw tensor bytes; each binary input names
its size in `parameters.binary_data_size`, in input order. BYTES elements are each a 4-byte
little-endian length followed by the bytes.

    | JSON header (N bytes) | input 0 raw bytes | input 1 raw bytes | ...

BF16 (bfloat16) elements are 2 bytes each, raw: the upper half of the float32 of the same value,
little-endian (what tritonclient sends from an `ml_dtypes.bfloat16` array); in JSON they are
numbers, rounded to the nearest bfloat16 (a finite number past its range is refused). A BF16
input is never converted to another datatype: a model that declares FP32 takes FP32, as in Triton.
"""

from __future__ import annotations

import array
import math
import sys
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from sluice import wire
from sluice.api.common import unreadable_json
from sluice.errors import InvalidInput, NotSupported

DATATYPES = wire.DATATYPES
NUMPY_TO_KSERVE = {str(v): k for k, v in DATATYPES.items()}
NUMPY_NAMES = {k: v.name for k, v in DATATYPES.items()}
"""KServe datatype -> the numpy dtype name a `wire.TensorPayload` carries."""
MAX_ELEMENTS = 16 * 1024 * 1024
MAX_DIMS = 16
# The Python type each JSON element must have: no strings for numbers, no numbers for BOOL.
_JSON_ELEMENT: dict[str, type] = {
    name: bool if name == "BOOL" else float if name in wire.FLOAT_DATATYPES else int for name in DATATYPES
}
# `array.array` type codes of the same size as the datatype: packing a list of Python numbers
# with one is a single C loop that refuses out-of-range integers (numpy takes several calls, each
# of which costs tens of microseconds when a lone request finds the caches cold).
_ARRAY_CODES = {name: code for name, code in (("INT8", "b"), ("UINT8", "B"), ("INT16", "h"), ("UINT16", "H"),
                                              ("INT32", "i"), ("UINT32", "I"), ("INT64", "q"), ("UINT64", "Q"),
                                              ("FP32", "f"), ("FP64", "d"))
                if array.array(code).itemsize == DATATYPES[name].itemsize}
_SWAP = sys.byteorder == "big"
SHARED_MEMORY_PARAMETERS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")
"""What `tritonclient`'s `set_shared_memory` puts in an input's or requested output's parameters."""
NO_SHARED_MEMORY = ("sluice does not support Triton's shared-memory extensions (system or CUDA): send tensors in "
                    "the request itself (JSON data, the binary tensor extension, or gRPC's raw_input_contents)")


def check_no_shared_memory(what: str, parameters: Any) -> None:
    """Refuse (501) an input or requested output (`what`: "input 'x'") placed in shared memory,
    rather than read no data for it or answer it elsewhere."""
    if any(name in parameters for name in SHARED_MEMORY_PARAMETERS):
        raise NotSupported(f"{what} is in shared memory: {NO_SHARED_MEMORY}")


class RequestedOutput(msgspec.Struct):
    name: str
    parameters: dict[str, Any] = {}


class _TensorHead(msgspec.Struct):
    name: str
    shape: list[int]
    datatype: str


class InputTensor(_TensorHead):
    data: Any = None
    parameters: dict[str, Any] = {}


class InferRequestBody(msgspec.Struct):
    inputs: list[InputTensor]
    id: str | None = None
    parameters: dict[str, Any] = {}
    outputs: list[RequestedOutput] | None = None


@dataclass(frozen=True, slots=True)
class Tensor:
    """An input as decoded, or an output to render."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes | list[bytes]
    """Numeric types: the elements' little-endian bytes, row-major; BYTES: the elements."""

    @property
    def values(self) -> np.ndarray | list[bytes]:
        """A numpy array (a view of `data`) for numeric types, the elements for BYTES."""
        if isinstance(self.data, list):
            return self.data
        return np.frombuffer(self.data, dtype=DATATYPES[self.datatype].newbyteorder("<")).reshape(self.shape)


class _NumbersInput(_TensorHead):
    data: list[int | float]
    parameters: dict[str, Any] = {}


class _NumbersBody(msgspec.Struct):
    """A JSON request whose inputs' `data` are all flat lists of numbers: the common case,
    decoded typed in one pass and packed without numpy (`InferRequestBody` decodes `data` as
    any JSON, checked against its datatype and converted afterwards)."""

    inputs: list[_NumbersInput]
    id: str | None = None
    parameters: dict[str, Any] = {}
    outputs: list[RequestedOutput] | None = None


def parse_request(body: bytes, header_length: int | None) -> tuple[InferRequestBody, list[Tensor]]:
    if header_length is None:
        # a body naming a BYTES or BOOL datatype would fail the typed decode, maybe late in a
        # large body: straight to the general path. (A byte search for one character is memchr,
        # 0.06 ms over 5 MB; the words are looked for only where a "B" is.)
        numbers = None if b"B" in body and (b"BYTES" in body or b"BOOL" in body) else _numbers_only(body)
        if numbers is not None:
            return numbers
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
        raise unreadable_json(exc, header) from exc
    if not request.inputs:
        raise InvalidInput("inference request has no inputs", param="inputs")
    tensors = []
    offset = 0
    for tensor in request.inputs:
        check_no_shared_memory(f"input {tensor.name!r}", tensor.parameters)
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


def _numbers_only(body: bytes) -> tuple[InferRequestBody, list[Tensor]] | None:
    """`parse_request` of a JSON body whose every input is a flat list of numbers for a numeric
    datatype other than BOOL; None for any other body, which the general path decodes (and whose
    errors it words, but for those found here too: a shape that does not hold the data)."""
    try:
        request = msgspec.json.decode(body, type=_NumbersBody)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        return None
    tensors = []
    for tensor in request.inputs:
        if tensor.datatype not in DATATYPES or tensor.datatype == "BOOL" or tensor.parameters:
            return None  # (`binary_data_size`, shared memory: the general path)
        count = _check_shape(tensor)
        if len(tensor.data) != count:
            raise InvalidInput(f"input {tensor.name!r}: {len(tensor.data)} values do not fill shape {tensor.shape}")
        try:
            data = pack_values(tensor, tensor.data)
        except TypeError:  # a float for an integer datatype: the general path says where
            return None
        tensors.append(Tensor(tensor.name, tensor.datatype, tuple(tensor.shape), data))
    if not tensors:
        return None
    inputs = [InputTensor(t.name, t.shape, t.datatype) for t in request.inputs]  # their data: `tensors`
    return InferRequestBody(inputs, request.id, request.parameters, request.outputs), tensors


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_shape(tensor: _TensorHead) -> int:
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
        wrong = next((i for i, v in enumerate(flat) if not isinstance(v, str)), None)
        if wrong is not None:
            raise InvalidInput(f"input {tensor.name!r}: BYTES element {wrong} is {_json_kind(flat[wrong])}, "
                               "not a string", param=tensor.name)
        if len(flat) != count:
            raise InvalidInput(f"input {tensor.name!r}: {len(flat)} strings do not fill shape {tensor.shape} "
                               f"({count} elements)", param=tensor.name)
        return Tensor(tensor.name, "BYTES", tuple(tensor.shape), [v.encode() for v in flat])
    numbers = _numeric_array(tensor)
    if numbers.size != count:
        raise InvalidInput(f"input {tensor.name!r}: {numbers.size} values do not fill shape {tensor.shape}")
    return Tensor(tensor.name, tensor.datatype, tuple(tensor.shape), numbers.tobytes())


def pack_values(tensor: _TensorHead, values: list[Any]) -> bytes:
    """A flat list of Python numbers of the datatype's kind (bool for BOOL, int for integers,
    float or int for floating point) as little-endian bytes; out-of-range values are refused."""
    code = _ARRAY_CODES.get(tensor.datatype)
    try:
        if code is None:  # BOOL, FP16, BF16
            return _checked_array(tensor, values).tobytes()
        packed = array.array(code, values)  # (a float for an integer datatype: TypeError, for the caller)
    except (OverflowError, ValueError) as exc:
        raise InvalidInput(f"input {tensor.name!r}: a value is out of range for {tensor.datatype}") from exc
    if code in "fd" and _has_inf(packed):  # JSON has no inf: a finite value overflowed
        raise InvalidInput(f"input {tensor.name!r}: a value is out of range for {tensor.datatype}")
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def _has_inf(packed: array.array[Any]) -> bool:
    if len(packed) <= 256:  # a few Python floats cost less than two numpy calls
        return any(map(math.isinf, packed))
    return bool(np.isinf(np.frombuffer(packed, dtype=np.float32 if packed.typecode == "f" else np.float64)).any())


def _numeric_array(tensor: InputTensor) -> np.ndarray:
    """JSON `data` (flat or nested, row-major) as a little-endian array, checking every
    element's JSON type first: numpy alone would turn `"1.5"` or `true` into a number."""
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
    return _checked_array(tensor, checked)


def _checked_array(tensor: _TensorHead, values: list[Any]) -> np.ndarray:
    """Values of the datatype's JSON kind (flat or nested) as a little-endian array of it; one
    out of its range is refused."""
    try:
        with np.errstate(over="ignore"):
            array = np.asarray(values, dtype=DATATYPES[tensor.datatype].newbyteorder("<"))
    except (ValueError, OverflowError) as exc:
        raise InvalidInput(f"input {tensor.name!r}: data is not a {tensor.datatype} array: {exc}") from exc
    if tensor.datatype in wire.FLOAT_DATATYPES and np.isinf(array).any():  # JSON has no inf: a finite value overflowed
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
        return Tensor(tensor.name, tensor.datatype, tuple(tensor.shape), pack_values(tensor, values))
    except TypeError as exc:
        raise InvalidInput(f"input {tensor.name!r}: values are not of the {tensor.datatype} kind") from exc


def tensor_from_raw(tensor: InputTensor, raw: bytes) -> Tensor:
    """An input given as raw little-endian bytes (the binary extension's, gRPC's `raw_input_contents`)."""
    count = _check_shape(tensor)
    if tensor.datatype == "BYTES":
        try:
            values = wire.decode_bytes_elements(raw)
        except ValueError as exc:  # a length that runs past the data
            raise InvalidInput(f"input {tensor.name!r}: {exc} (each element is a 4-byte little-endian "
                               "length and that many bytes)", param=tensor.name) from exc
        if len(values) != count:
            raise InvalidInput(f"input {tensor.name!r}: {len(values)} BYTES elements do not fill "
                               f"shape {tensor.shape} ({count} elements)", param=tensor.name)
        return Tensor(tensor.name, "BYTES", tuple(tensor.shape), values)
    if len(raw) != count * DATATYPES[tensor.datatype].itemsize:
        raise InvalidInput(f"input {tensor.name!r}: {len(raw)} bytes do not match shape {tensor.shape}")
    return Tensor(tensor.name, tensor.datatype, tuple(tensor.shape), bytes(raw))


def check_input(tensor: Tensor, expected: wire.TensorSpec) -> None:
    """An input of the datatype its model declares, of a shape that fits the declared one (`_fits_shape`)."""
    if tensor.datatype != expected.datatype:
        raise InvalidInput(f"input {tensor.name!r} must be {expected.datatype}, got {tensor.datatype}",
                           param=tensor.name)
    if not _fits_shape(tensor.shape, expected):
        raise InvalidInput(f"input {tensor.name!r} must have shape like {list(expected.shape)}, "
                           f"got {list(tensor.shape)}", param=tensor.name)


def _fits_shape(shape: tuple[int, ...], expected: wire.TensorSpec) -> bool:
    """Same rank with every fixed dimension equal; BYTES also takes `[n, 1]` for `[n]`."""
    if expected.datatype == "BYTES" and len(expected.shape) == 1 and len(shape) == 2 and shape[1] == 1:
        shape = shape[:1]
    if len(shape) != len(expected.shape):
        return False
    return all(e < 0 or d == e for d, e in zip(shape, expected.shape, strict=True))


def texts_of(tensor: Tensor) -> list[str]:
    """A BYTES input's elements as text; a 400 for another datatype or bytes that are not UTF-8."""
    if not isinstance(tensor.data, list):
        raise InvalidInput(f"input {tensor.name!r} must be BYTES, got {tensor.datatype}")
    texts = []
    for i, value in enumerate(tensor.data):
        try:
            texts.append(value.decode())
        except UnicodeDecodeError as exc:
            raise InvalidInput(f"input {tensor.name!r}: element {i} holds bytes that are not UTF-8 text "
                               f"({exc.reason} at byte {exc.start})", param=tensor.name) from exc
    return texts


def decode_bytes_elements(raw: bytes) -> list[bytes]:
    try:
        return wire.decode_bytes_elements(raw)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from exc


encode_bytes_elements = wire.encode_bytes_elements


def _json_kind(value: Any) -> str:
    """What a JSON value is, in JSON's words, for a message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "an object" if isinstance(value, dict) else f"a {type(value).__name__}"


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


def render_outputs(outputs: list[Tensor], binary_names: set[str]) -> tuple[list[dict[str, Any]], bytes]:
    """JSON output entries, and the raw bytes of the outputs asked for in binary (in order).
    BYTES elements go into JSON as text (undecodable bytes replaced: ask for such an output in
    binary to get them as they are)."""
    entries = []
    raw_parts = []
    for output in outputs:
        entry: dict[str, Any] = {"name": output.name, "datatype": output.datatype, "shape": list(output.shape)}
        if output.name in binary_names:
            raw = raw_bytes(output)
            entry["parameters"] = {"binary_data_size": len(raw)}
            raw_parts.append(raw)
        elif isinstance(output.data, list):
            entry["data"] = [value.decode("utf-8", "replace") for value in output.data]
        else:
            entry["data"] = unpack_values(output.datatype, output.data)
        entries.append(entry)
    return entries, b"".join(raw_parts)


def raw_bytes(tensor: Tensor) -> bytes:
    """A tensor's elements as the binary extension and gRPC's raw contents carry them."""
    return encode_bytes_elements(tensor.data) if isinstance(tensor.data, list) else tensor.data


def unpack_values(datatype: str, data: bytes) -> list[Any]:
    """Little-endian elements as a flat list of Python numbers (bools for BOOL; floats for BF16,
    each exactly the element's value)."""
    code = _ARRAY_CODES.get(datatype)
    if code is None:
        return np.frombuffer(data, dtype=DATATYPES[datatype].newbyteorder("<")).tolist()
    values = array.array(code, data)
    if _SWAP:
        values.byteswap()
    return values.tolist()

"""The KServe v2 tensor codec: JSON data (flat or nested), the binary extension, and its errors."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import msgspec
import numpy as np
import pytest

from sluice.api.tensors import (
    DATATYPES,
    MAX_ELEMENTS,
    Tensor,
    decode_bytes_elements,
    encode_bytes_elements,
    parse_request,
    render_outputs,
)
from sluice.errors import InvalidInput


def _json_request(*inputs: dict, **extra) -> bytes:
    return json.dumps({"inputs": list(inputs), **extra}).encode()


def _binary_request(arrays: dict[str, tuple[str, np.ndarray | list[bytes]]]) -> tuple[bytes, int]:
    """A binary-extension body: JSON header, then each input's raw bytes in order."""
    entries, parts = [], []
    for name, (datatype, values) in arrays.items():
        if datatype == "BYTES":
            raw, shape = encode_bytes_elements(values), [len(values)]
        else:
            raw, shape = values.astype(values.dtype.newbyteorder("<")).tobytes(), list(values.shape)
        entries.append(
            {"name": name, "datatype": datatype, "shape": shape, "parameters": {"binary_data_size": len(raw)}}
        )
        parts.append(raw)
    header = json.dumps({"inputs": entries}).encode()
    return header + b"".join(parts), len(header)


# -- JSON -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("data", [[1, 2, 3, 4, 5, 6], [[1, 2, 3], [4, 5, 6]], [[1.0, 2, 3.5], [4, 5, 6]]])
def test_json_flat_and_nested_data_give_the_same_shape(data):
    request, (tensor,) = parse_request(
        _json_request({"name": "x", "shape": [2, 3], "datatype": "FP32", "data": data}), None
    )
    assert tensor.shape == (2, 3)
    assert tensor.values.dtype == np.float32
    np.testing.assert_array_equal(tensor.values, np.asarray(data, dtype=np.float32).reshape(2, 3))
    assert request.outputs is None and request.id is None


@pytest.mark.parametrize(
    "datatype, data, dtype",
    [
        ("INT64", [-(2**63), 2**63 - 1], np.int64),
        ("UINT8", [0, 255], np.uint8),
        ("BOOL", [True, False], np.bool_),
        ("FP64", [1e300, -2.5], np.float64),
        ("FP16", [1, 0.5], np.float16),
        ("INT8", [-128, 127], np.int8),
    ],
)
def test_json_numeric_datatypes(datatype, data, dtype):
    _, (tensor,) = parse_request(_json_request({"name": "x", "shape": [2], "datatype": datatype, "data": data}), None)
    assert tensor.values.dtype == dtype
    assert tensor.values.tolist() == data


def test_json_scalar_data_fills_a_one_element_shape():
    _, (tensor,) = parse_request(_json_request({"name": "x", "shape": [1, 1], "datatype": "FP32", "data": 7}), None)
    assert tensor.values.tolist() == [[7.0]]


def test_json_bytes_flat_and_nested():
    body = _json_request({"name": "t", "shape": [2, 1], "datatype": "BYTES", "data": [["h\u00e9"], ["b"]]})
    _, (tensor,) = parse_request(body, None)
    assert tensor.values == ["h\u00e9".encode(), b"b"]
    assert tensor.shape == (2, 1)


def test_request_fields_are_kept():
    body = _json_request(
        {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]},
        id="abc",
        parameters={"timeout": 5},
        outputs=[{"name": "y", "parameters": {"binary_data": True}}],
    )
    request, _ = parse_request(body, None)
    assert request.id == "abc"
    assert request.parameters == {"timeout": 5}
    assert request.outputs[0].name == "y" and request.outputs[0].parameters == {"binary_data": True}


def test_zero_sized_tensor_is_allowed():
    _, (tensor,) = parse_request(_json_request({"name": "x", "shape": [0, 4], "datatype": "FP32", "data": []}), None)
    assert tensor.values.shape == (0, 4)


def _json_error(entry: dict) -> str:
    with pytest.raises(InvalidInput) as caught:
        parse_request(_json_request({"name": "x", "shape": [2], "datatype": "FP32", "data": [1, 2], **entry}), None)
    return caught.value.message


@pytest.mark.parametrize(
    "entry, fragment",
    [
        ({"data": ["1", "2"]}, "got `str` - at `data[0]`"),
        ({"data": [1, True]}, "got `bool` - at `data[1]`"),
        ({"data": [1, None]}, "got `null`"),
        ({"data": [[1], [2, 3]]}, "FP32"),
        ({"data": [[1], 2]}, "data[1]"),
        ({"data": [1, 2, 3]}, "3 values do not fill shape [2]"),
        ({"data": None}, "has no data"),
        ({"data": [1e39, 0]}, "out of range for FP32"),
        ({"datatype": "INT8", "data": [1, 300]}, "INT8"),
        ({"datatype": "UINT32", "data": [1, -1]}, "UINT32"),
        ({"datatype": "INT32", "data": [1.5, 2]}, "got `float`"),
        ({"datatype": "BOOL", "data": [1, 0]}, "got `int`"),
        ({"datatype": "FP8"}, "unknown datatype 'FP8'"),
        ({"shape": []}, "non-negative integers"),
        ({"shape": [2, -1]}, "non-negative integers"),
        ({"shape": [1] * 17, "data": [1]}, "at most 16"),
        ({"shape": [MAX_ELEMENTS + 1]}, "more than"),
        ({"shape": [0, 2**62], "data": []}, "more than"),
        ({"shape": [2**40, 2**40]}, "more than"),
        ({"datatype": "BYTES", "data": ["a", 2]}, "element 1 is a number, not a string"),
        ({"datatype": "BYTES", "data": ["a"]}, "1 strings do not fill shape [2]"),
    ],
)
def test_json_errors_name_the_input_and_the_problem(entry, fragment):
    message = _json_error(entry)
    assert fragment in message
    assert "'x'" in message or "input" in message


@pytest.mark.parametrize(
    "body, fragment",
    [
        (b"{", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[]", "Expected `object`"),
        (b'{"inputs": []}', "no inputs"),
        (b'{"inputs": [{"name": "x"}]}', "missing required field"),
        (b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}], "parameters": 3}', "parameters"),
    ],
)
def test_request_level_errors(body, fragment):
    with pytest.raises(InvalidInput, match=fragment.replace("[", r"\[")):
        parse_request(body, None)


# -- binary ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int8, np.int64, np.uint16, np.bool_])
def test_binary_numeric_round_trip(dtype):
    values = (np.arange(12).reshape(3, 4) % 2 == 0) if dtype is np.bool_ else np.arange(12, dtype=dtype).reshape(3, 4)
    datatype = {
        np.float32: "FP32",
        np.float16: "FP16",
        np.float64: "FP64",
        np.int8: "INT8",
        np.int64: "INT64",
        np.uint16: "UINT16",
        np.bool_: "BOOL",
    }[dtype]
    body, header_length = _binary_request({"a": (datatype, values)})
    _, (tensor,) = parse_request(body, header_length)
    assert tensor.shape == (3, 4)
    np.testing.assert_array_equal(tensor.values, values)


def test_binary_bytes_and_numeric_inputs_in_order():
    texts = [b"hello", b"", "caf\u00e9".encode(), b"\x00\xff"]
    numbers = np.array([[1.5, -2.0]], dtype=np.float32)
    body, header_length = _binary_request({"t": ("BYTES", texts), "n": ("FP32", numbers)})
    _, (text_tensor, number_tensor) = parse_request(body, header_length)
    assert text_tensor.values == texts  # raw bytes: UTF-8 is the model adapter's business
    np.testing.assert_array_equal(number_tensor.values, numbers)


def test_binary_and_json_inputs_mix():
    raw = np.ones(2, dtype=np.float32).tobytes()
    header = _json_request(
        {"name": "a", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 8}},
        {"name": "b", "shape": [2], "datatype": "FP32", "data": [3, 4]},
    )
    _, (a, b) = parse_request(header + raw, len(header))
    assert a.values.tolist() == [1.0, 1.0] and b.values.tolist() == [3.0, 4.0]


def _binary_error(size, raw: bytes, shape=(2,), datatype="FP32", header_length=None) -> str:
    header = _json_request(
        {"name": "x", "shape": list(shape), "datatype": datatype, "parameters": {"binary_data_size": size}}
    )
    with pytest.raises(InvalidInput) as caught:
        parse_request(header + raw, len(header) if header_length is None else header_length)
    return caught.value.message


@pytest.mark.parametrize(
    "size, raw, fragment",
    [
        (9, b"\0" * 8, "binary_data_size does not match"),
        (-1, b"\0" * 8, "binary_data_size does not match"),
        (True, b"\0" * 8, "binary_data_size does not match"),
        ("8", b"\0" * 8, "binary_data_size does not match"),
        (4, b"\0" * 4, "4 bytes do not match shape [2]"),
        (8, b"\0" * 12, "longer than the inputs' binary_data_size"),
    ],
)
def test_binary_size_errors(size, raw, fragment):
    assert fragment in _binary_error(size, raw)


def test_header_length_past_the_body_or_inside_the_json():
    raw = b"\0" * 8
    assert "larger than the body" in _binary_error(8, raw, header_length=10**6)
    assert "not valid JSON" in _binary_error(8, raw, header_length=3)


@pytest.mark.parametrize(
    "raw, fragment",
    [
        (b"\x05\x00", "truncated BYTES element length"),
        (struct.pack("<I", 10) + b"abc", "truncated BYTES element"),
        (struct.pack("<I", 1) + b"a" + struct.pack("<I", 1) + b"b", "2 BYTES elements do not fill shape [1]"),
    ],
)
def test_binary_bytes_errors(raw, fragment):
    assert fragment in _binary_error(len(raw), raw, shape=(1,), datatype="BYTES")


def test_bytes_elements_round_trip():
    values = [b"", b"a", "\u00fc".encode() * 100, bytes(range(256))]
    assert decode_bytes_elements(encode_bytes_elements(values)) == values
    assert encode_bytes_elements([b"ab"]) == b"\x02\x00\x00\x00ab"


# -- outputs --------------------------------------------------------------------------------------


def test_render_outputs_json_and_binary():
    first = np.arange(6, dtype=np.float32).reshape(2, 3)
    second = np.array([1, -2], dtype=np.int64)
    entries, raw = render_outputs([Tensor("a", "FP32", first.shape, first.tobytes()),
                                   Tensor("b", "INT64", second.shape, second.astype("<i8").tobytes())], {"b"})
    assert entries[0] == {"name": "a", "datatype": "FP32", "shape": [2, 3], "data": [0, 1, 2, 3, 4, 5]}
    assert entries[1] == {"name": "b", "datatype": "INT64", "shape": [2], "parameters": {"binary_data_size": 16}}
    assert np.frombuffer(raw, dtype="<i8").tolist() == [1, -2]
    assert msgspec.json.encode(entries)  # plain JSON values only


@pytest.mark.parametrize("datatype", sorted(DATATYPES))
def test_every_numeric_datatype_round_trips_through_json(datatype):
    """Packed from JSON numbers and rendered back, the values are numpy's for the datatype."""
    dtype = DATATYPES[datatype]
    if dtype.kind == "b":
        data = [True, False, True]
    elif dtype.kind == "f" or datatype == "BF16":
        data = [0.5, -1.25, float(ml_dtypes.finfo(dtype).max)]
    else:
        info = np.iinfo(dtype)
        data = [int(info.min), 0, int(info.max)]
    _, (tensor,) = parse_request(_json_request({"name": "x", "shape": [3], "datatype": datatype, "data": data}), None)
    assert tensor.data == np.array(data, dtype=dtype.newbyteorder("<")).tobytes()
    (entry,), _ = render_outputs([Tensor("y", datatype, (3,), tensor.data)], set())
    assert entry["data"] == data


def test_bf16_json_numbers_round_to_the_nearest_bfloat16_and_render_exactly():
    """BF16 from JSON: each number rounded to the nearest bfloat16 (ties to even), the bytes
    tritonclient would send for the same `ml_dtypes.bfloat16` array; rendered back as the exact
    values. A finite number past its range is refused (JSON has no infinity)."""
    data = [3.14159, 1 + 2**-8, 1 + 3 * 2**-8, -1e-40, 65504, 3e38]
    _, (tensor,) = parse_request(_json_request({"name": "x", "shape": [2, 3], "datatype": "BF16", "data": data}), None)
    expected = np.array(data, dtype=ml_dtypes.bfloat16)
    assert tensor.data == expected.tobytes()
    assert tensor.data[:2] == (np.float32(3.140625).view(np.uint32) >> 16).astype("<u2").tobytes()  # float32's top half
    assert tensor.values.dtype == ml_dtypes.bfloat16 and tensor.values.shape == (2, 3)
    (entry,), _ = render_outputs([tensor], set())
    assert entry["data"] == [3.140625, 1.0, 1 + 2**-6, *expected[3:].astype(np.float64).tolist()]
    for value in (1e39, -3.4e38):
        with pytest.raises(InvalidInput, match="out of range for BF16"):
            parse_request(_json_request({"name": "x", "shape": [1], "datatype": "BF16", "data": [value]}), None)


def test_bf16_binary_keeps_every_bit_and_checks_the_size():
    bits = np.arange(2**16, dtype=np.uint16)  # NaNs and infinities too: raw bytes are not looked at
    body, header_length = _binary_request({"x": ("BF16", bits.view(ml_dtypes.bfloat16).reshape(256, 256))})
    _, (tensor,) = parse_request(body, header_length)
    assert tensor.data == bits.astype("<u2").tobytes() and tensor.shape == (256, 256)
    entries, raw = render_outputs([tensor], {"x"})
    assert raw == tensor.data and entries[0]["parameters"] == {"binary_data_size": 2**17}
    assert "3 bytes do not match shape [2]" in _binary_error(3, b"\0" * 3, datatype="BF16")
    assert "4 bytes do not match shape [1]" in _binary_error(4, b"\0" * 4, shape=(1,), datatype="BF16")


def test_integers_beyond_a_doubles_precision_stay_exact_and_mixed_inputs_parse():
    """Flat numeric inputs are decoded in one typed pass; a body with any other input (here
    BYTES) takes the general path, with the same results."""
    big = [2**62 + 1, -(2**62) - 1]
    numbers = {"name": "n", "shape": [2], "datatype": "INT64", "data": big}
    _, (alone,) = parse_request(_json_request(numbers), None)
    text = {"name": "t", "shape": [1], "datatype": "BYTES", "data": ["hi"]}
    _, (mixed, words) = parse_request(_json_request(numbers, text), None)
    assert alone.values.tolist() == mixed.values.tolist() == big
    assert words.values == [b"hi"]
    named = {"name": "BOOL_OR_BYTES", "shape": [2], "datatype": "INT64", "data": big}  # the general path too
    _, (same,) = parse_request(_json_request(named), None)
    assert same.values.tolist() == big and same.name == "BOOL_OR_BYTES"

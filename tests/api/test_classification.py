"""Triton's classification extension: an output's top classes, as Triton writes them."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from sluice import wire
from sluice.api.classification import class_counts, top_classes
from sluice.api.tensors import Tensor
from sluice.errors import InvalidInput


def _tensor(values: np.ndarray, datatype: str) -> Tensor:
    return Tensor("scores", datatype, values.shape, values.astype(values.dtype.newbyteorder("<")).tobytes())


def _classes(values: np.ndarray, datatype: str, count: int,
             is_batched: bool = True) -> tuple[tuple[int, ...], list[str]]:
    result = top_classes(_tensor(values, datatype), count, is_batched)
    assert result.datatype == "BYTES" and isinstance(result.data, list)
    return result.shape, [entry.decode() for entry in result.data]


def test_each_rows_highest_values_first_with_six_decimals():
    values = np.array([[0.1, 0.7, 0.2], [0.5, 0.1, 0.4]], np.float32)
    assert _classes(values, "FP32", 2) == ((2, 2), ["0.700000:1", "0.200000:2", "0.500000:0", "0.400000:2"])


def test_bf16_scores_are_classified_as_floats():
    values = np.array([[0.1, 0.75, -2.5]], ml_dtypes.bfloat16)
    assert _classes(values, "BF16", 3) == ((1, 3), ["0.750000:1", "0.100098:0", "-2.500000:2"])


def test_equal_values_come_in_index_order():
    values = np.array([[5, 1, 5, 5]], np.int32)
    assert _classes(values, "INT32", 3) == ((1, 3), ["5:0", "5:2", "5:3"])


def test_unsigned_and_negative_values_keep_their_order():
    assert _classes(np.array([[1, 2**64 - 1, 2]], np.uint64), "UINT64", 2)[1] == ["18446744073709551615:1", "2:2"]
    assert _classes(np.array([[-3, -1, -2]], np.int8), "INT8", 3)[1] == ["-1:1", "-2:2", "-3:0"]


def test_a_row_holds_at_most_its_elements_and_rows_of_several_dimensions_are_flattened():
    assert _classes(np.array([[2.0], [3.0]], np.float64), "FP64", 5) == ((2, 1), ["2.000000:0", "3.000000:0"])
    cube = np.arange(8, dtype=np.float32).reshape(2, 2, 2)
    assert _classes(cube, "FP32", 1) == ((2, 1), ["3.000000:3", "7.000000:3"])


def test_an_unbatched_model_classifies_the_whole_tensor_and_no_rows_give_no_classes():
    assert _classes(np.array([[1.0, 4.0], [3.0, 2.0]], np.float32), "FP32", 2, is_batched=False) == \
        ((2,), ["4.000000:1", "3.000000:2"])
    assert _classes(np.zeros((0, 3), np.float32), "FP32", 2) == ((0, 2), [])


def _info() -> wire.ModelInfo:
    outputs = (wire.TensorSpec("scores", "FP32", (-1, 3)), wire.TensorSpec("label", "BYTES", (-1,)),
               wire.TensorSpec("flag", "BOOL", (-1,)))
    return wire.ModelInfo(name="m", version="1", kind="python", platform="sluice_python",
                          inputs=(wire.TensorSpec("x", "FP32", (-1, 3)),), outputs=outputs, max_batch_size=8,
                          slo_s=1.0, accepts_text=False, accepts_tensor=True)


@pytest.mark.parametrize("name, count, words", [
    ("scores", 0, "positive integer"), ("scores", -2, "positive integer"), ("scores", True, "positive integer"),
    ("scores", 2.5, "positive integer"), ("scores", "3", "positive integer"),
    ("label", 1, "numeric"), ("flag", 1, "numeric"),
])
def test_counts_that_cannot_be_answered_are_refused_before_inference(name, count, words):
    with pytest.raises(InvalidInput, match=words):
        class_counts(_info(), [(name, count)])


def test_counts_are_read_only_for_the_outputs_that_ask():
    assert class_counts(_info(), [("scores", 3), ("label", None)]) == {"scores": 3}

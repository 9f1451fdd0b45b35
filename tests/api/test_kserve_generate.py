"""KServe v2 infer on a generative model (`api.kserve_generate`): the `text_input` tensor is
checked against the model's metadata as any other model's input is."""

from __future__ import annotations

import pytest

from sluice import wire
from sluice.api.kserve_generate import text_request
from sluice.api.tensors import Tensor
from sluice.errors import InvalidInput

INFO = wire.ModelInfo("lm", "1", "generative", "sluice_generative",
                      (wire.TensorSpec("text_input", "BYTES", (-1,)),),
                      (wire.TensorSpec("text_output", "BYTES", (-1,)),), 32, 60.0, True, False, max_model_len=128)


def _prompts(shape: tuple[int, ...], count: int) -> Tensor:
    return Tensor("text_input", "BYTES", shape, [b"hi %d" % i for i in range(count)])


@pytest.mark.parametrize("shape", [(2,), (2, 1)])
def test_one_prompt_per_element_of_the_declared_shape_or_a_trailing_unit_dimension(shape):
    request = text_request(INFO, [_prompts(shape, 2)], {"max_tokens": 2}, stream_route=None)
    assert request.prompts == ["hi 0", "hi 1"]


@pytest.mark.parametrize("shape", [(2, 2), (1, 1, 1), (1, 2)])
def test_a_text_input_of_a_shape_the_metadata_does_not_declare_is_400_not_flattened(shape):
    count = 1
    for dim in shape:
        count *= dim
    with pytest.raises(InvalidInput, match=r"input 'text_input' must have shape like \[-1\]") as caught:
        text_request(INFO, [_prompts(shape, count)], {"max_tokens": 2}, stream_route=None)
    assert caught.value.param == "text_input"

"""The request-level parameters of a KServe v2 infer request (`api.kserve.request_terms`), read
alike for HTTP and gRPC."""

from __future__ import annotations

import pytest

from sluice.api.kserve import request_terms
from sluice.errors import InvalidInput
from sluice.priority import Priority


@pytest.mark.parametrize("raw, expected", [
    (None, None), (0, None), (1, Priority.INTERACTIVE), (2, Priority.STANDARD), (3, Priority.BATCH),
    (2**64 - 1, Priority.BATCH), ("batch", Priority.BATCH),
])
def test_priority_is_a_tritons_level_or_a_class_name(raw, expected):
    assert request_terms({"priority": raw}, None, 60.0) == (None, expected)


@pytest.mark.parametrize("raw", [1.5, 1.0, True, -1, [1], {"level": 1}])
def test_a_priority_that_is_neither_says_a_level_is_allowed_too(raw):
    words = r"non-negative level \(an integer, 1 the highest\) or a class name"
    with pytest.raises(InvalidInput, match=words) as caught:
        request_terms({"priority": raw}, None, 60.0)
    assert caught.value.param == "priority"

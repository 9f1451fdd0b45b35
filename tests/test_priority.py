"""Priority classes as clients name them: OpenAI's `service_tier` values, ours, and the rule that a
request may lower its tenant's class but never raise it."""

from __future__ import annotations

import pytest

from sluice.errors import InvalidInput
from sluice.priority import Priority, effective_priority, parse_priority, priority_from_wire


@pytest.mark.parametrize("value, expected", [
    ("auto", None), ("default", None), ("flex", Priority.BATCH), ("priority", Priority.INTERACTIVE),
    ("scale", Priority.INTERACTIVE), ("Standard", Priority.STANDARD), (None, None),
])
def test_every_service_tier_the_openai_sdk_sends_is_understood(value: str | None, expected: Priority | None):
    assert parse_priority(value, "service_tier") is expected


def test_an_unknown_class_is_a_400_naming_the_field_and_the_choices():
    with pytest.raises(InvalidInput, match=r"'service_tier' must be one of .*scale.*; got 'turbo'") as caught:
        parse_priority("turbo", "service_tier")
    assert caught.value.param == "service_tier"


def test_scale_cannot_raise_a_tenants_class():
    assert effective_priority(Priority.BATCH, parse_priority("scale")) is Priority.BATCH


def test_a_worker_reads_a_class_it_does_not_know_from_a_newer_gateway_as_standard():
    assert [priority_from_wire(value) for value in (0, 1, 2)] == [Priority.INTERACTIVE, Priority.STANDARD,
                                                                  Priority.BATCH]
    assert priority_from_wire(7) is Priority.STANDARD

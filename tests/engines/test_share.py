"""Workers of one `sluice serve` split an external upstream's concurrency limit between them."""

from __future__ import annotations

import pytest

from sluice.engines.base import share_of


@pytest.mark.parametrize("count", [1, 2, 3, 5])
@pytest.mark.parametrize("total", [1, 2, 3, 4, 7, 8, 16, 33])
def test_the_parts_add_up_to_the_limit_and_differ_by_at_most_one(total: int, count: int) -> None:
    parts = [share_of(total, (index, count)) for index in range(count)]
    assert sum(parts) == max(total, count)  # each worker gets at least one call
    assert max(parts) - min(parts) <= 1


def test_a_lone_worker_takes_the_whole_limit() -> None:
    assert share_of(16, (0, 1)) == 16

"""Replica choice, pure policy: power of two choices over predicted wait.

Each candidate's predicted wait is the work ahead its worker last reported plus an estimate of
what this gateway has sent it since that report. Two candidates are sampled and the less loaded
one wins, which avoids the herding that "always the least loaded" causes when reports are stale.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Candidate:
    worker_id: str
    predicted_wait_s: float


def choose(candidates: Sequence[Candidate], rng: random.Random) -> Candidate | None:
    if not candidates:
        return None
    if len(candidates) == 1:
        return candidates[0]
    first, second = rng.sample(range(len(candidates)), 2)
    a, b = candidates[first], candidates[second]
    return a if a.predicted_wait_s <= b.predicted_wait_s else b

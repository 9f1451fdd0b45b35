"""Shadow traffic, pure policy: which requests are copied to a model's shadow version, and whether
the copy answered as the version the client got its answer from did.

    request that names no version ─▶ routed to version R (`gateway.traffic`) ─▶ answer to the client
                 │  R is not the shadow version, and a draw < share
                 └──▶ copy to the shadow version S (batch class, the original's deadline) ─▶ measured,
                      compared with R's answer (`same_answer`), thrown away

An operator sets at most one shadow per model (`Shadows.start`); a copy is never answered to a
client, never served from nor written to the result cache, never counted against the tenant's
limits or budgets, nor in a canary's judgement. Requests that name their version are not copied
(their caller chose it), nor are those routed to the shadow version itself.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from sluice import wire

__all__ = ["RELATIVE_TOLERANCE", "Shadow", "Shadows", "same_answer"]

RELATIVE_TOLERANCE = 1e-3
"""Numbers in two answers are the same within this relative difference (and `_ABSOLUTE_TOLERANCE`
near zero): two versions on other hardware, batch sizes or kernels rarely agree to the last bit."""
_ABSOLUTE_TOLERANCE = 1e-6


@dataclass(frozen=True, slots=True)
class Shadow:
    """A model's shadow: the version copies go to, and the share (0, 1] of eligible requests copied."""

    version: str
    share: float = 1.0

    def check(self) -> None:
        """Raise ValueError for a shadow that cannot run."""
        if isinstance(self.share, bool) or not isinstance(self.share, int | float) or not math.isfinite(self.share) \
                or not 0 < self.share <= 1:
            raise ValueError(f"share must be a number in (0, 1], got {self.share!r}")
        if not self.version:
            raise ValueError("a shadow needs a version")

    def to_json(self) -> dict[str, object]:
        return {"version": self.version, "share": self.share}


class Shadows:
    """Each model's shadow, as operators set them."""

    def __init__(self) -> None:
        self._shadows: dict[str, Shadow] = {}

    def start(self, model: str, shadow: Shadow) -> None:
        """Set (or replace) `model`'s shadow. Raises ValueError for one that cannot run."""
        shadow.check()
        self._shadows[model] = shadow

    def stop(self, model: str) -> Shadow | None:
        """Stop `model`'s shadow; the one stopped, None if none ran."""
        return self._shadows.pop(model, None)

    def get(self, model: str) -> Shadow | None:
        return self._shadows.get(model)

    def target(self, model: str, routed: str, rng: random.Random) -> str | None:
        """The version to copy a request to `model` that named no version and was routed to
        `routed`: the shadow's, for a `share` of them; None for the others."""
        shadow = self._shadows.get(model)
        if shadow is None or shadow.version == routed:
            return None
        if shadow.share < 1 and rng.random() >= shadow.share:
            return None
        return shadow.version


def same_answer(answered: wire.Payload, copied: wire.Payload) -> bool | None:
    """Whether the copy's outputs are those the client got: the same shapes, types and names, and
    numbers within `RELATIVE_TOLERANCE`. None for answers this does not compare (generations:
    sampled text differs between runs of one version)."""
    if isinstance(answered, wire.TensorPayload) and isinstance(copied, wire.TensorPayload):
        return _same_tensor(answered.dtype, answered.shape, answered.data, copied.dtype, copied.shape, copied.data)
    if isinstance(answered, wire.TensorsPayload) and isinstance(copied, wire.TensorsPayload):
        mine = {t.name: t for t in answered.tensors}
        theirs = {t.name: t for t in copied.tensors}
        return mine.keys() == theirs.keys() and all(
            _same_tensor(_numpy_name(a.datatype), a.shape, a.data, _numpy_name(b.datatype), b.shape, b.data)
            for a, b in ((mine[name], theirs[name]) for name in mine))
    if type(answered) is not type(copied):
        return False if _comparable(answered) and _comparable(copied) else None
    return None


def _numpy_name(datatype: str) -> str:
    """A KServe datatype's numpy name; the datatype itself (compared as bytes) for BYTES and the like."""
    known = wire.DATATYPES.get(datatype)
    return datatype if known is None else known.name


def _comparable(payload: wire.Payload) -> bool:
    return isinstance(payload, wire.TensorPayload | wire.TensorsPayload)


def _same_tensor(dtype_a: str, shape_a: tuple[int, ...] | list[int], data_a: bytes,
                 dtype_b: str, shape_b: tuple[int, ...] | list[int], data_b: bytes) -> bool:
    if dtype_a != dtype_b or tuple(shape_a) != tuple(shape_b):
        return False
    if data_a == data_b:
        return True
    try:
        a = np.frombuffer(data_a, dtype=dtype_a).astype(np.float64)
        b = np.frombuffer(data_b, dtype=dtype_b).astype(np.float64)
    except (TypeError, ValueError):  # not numbers (BYTES, a string dtype): equal bytes only
        return False
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=RELATIVE_TOLERANCE, atol=_ABSOLUTE_TOLERANCE,
                                                    equal_nan=True))

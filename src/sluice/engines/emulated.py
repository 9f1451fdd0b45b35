"""An accelerator emulator, so scheduling and load behaviour can be measured without a GPU.

A batch of n items whose longest item has L elements occupies the device for
`alpha + beta * n * L / ref_len` seconds (padding, as on a transformer), times an optional
jitter factor; one batch at a time. Tensor items (FP32 rows) return their sum; text items
return a small deterministic unit vector, so results can be checked. Items with NaN/Inf fail
alone, and `error_rate` injects random per-item faults. `prepare_ms_per_kchar` emulates a
tokenizer: preparing a text request takes that long per 1,000 characters, slept without the GIL
as a real tokenizer's batch encoding runs.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Sequence

import numpy as np

from sluice import wire
from sluice.engines.base import ItemFailure, PreparedItem, fp32_rows, rows_model_info, stack_rows
from sluice.errors import ConfigError, InvalidInput
from sluice.repository import ModelVersion

_SPIN_S = 0.0002
"""The end of a batch is spun rather than slept: at most 0.2 ms of CPU per batch (~1% of a core at
capacity), where oversleeping would add its lateness to every request's latency."""


_PARAMS = ("alpha_ms", "beta_ms", "ref_len", "jitter", "error_rate", "max_len", "dims", "prepare_ms_per_kchar", "seed")
"""The emulator's `[params]`: anything else is a mistake (a misspelt `alpah_ms`), not ignored."""


class EmulatedRunner:
    def __init__(self, version: ModelVersion, device: str) -> None:
        p = version.params
        unknown = sorted(set(p) - set(_PARAMS))
        if unknown:
            raise ConfigError(f"{version.name}: [params] has no emulator parameter {unknown[0]!r} "
                              f"(it has {', '.join(_PARAMS)})")
        try:
            self.alpha_s = float(p.get("alpha_ms", 8.0)) / 1000
            self.beta_s = float(p.get("beta_ms", 0.5)) / 1000
            self.ref_len = int(p.get("ref_len", 16))
            self.jitter = float(p.get("jitter", 0.0))
            self.error_rate = float(p.get("error_rate", 0.0))
            self.max_len = int(p.get("max_len", 4096))
            self.dims = int(p.get("dims", 16))
            self.prepare_s_per_char = float(p.get("prepare_ms_per_kchar", 0.0)) / 1e6
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{version.name}: bad emulator parameter: {exc}") from exc
        for name, ok, needs in (
                ("alpha_ms", math.isfinite(self.alpha_s) and self.alpha_s >= 0, "a number of ms >= 0"),
                ("beta_ms", math.isfinite(self.beta_s) and self.beta_s >= 0, "a number of ms >= 0"),
                ("ref_len", self.ref_len >= 1, "an integer >= 1"),
                ("jitter", math.isfinite(self.jitter) and self.jitter >= 0, "a number >= 0"),
                ("error_rate", 0 <= self.error_rate <= 1, "between 0 and 1"),
                ("max_len", self.max_len >= 1, "an integer >= 1"),
                ("dims", self.dims >= 1, "an integer >= 1"),
                ("prepare_ms_per_kchar", math.isfinite(self.prepare_s_per_char) and self.prepare_s_per_char >= 0,
                 "a number >= 0")):
            if not ok:
                raise ConfigError(f"{version.name}: emulator parameter {name} must be {needs}, got {p.get(name)!r}")
        self._rng = random.Random(int(p.get("seed", 0)))
        self.device = device
        self.info = rows_model_info(version)

    def prior(self) -> tuple[float, float, float]:
        return self.alpha_s, self.beta_s / self.ref_len, float(self.ref_len)

    def warmup(self) -> list[tuple[int, float]]:
        return []  # the emulator's timing is known exactly; nothing to learn at start

    def prepare(self, payload: wire.Payload) -> list[PreparedItem]:
        if isinstance(payload, wire.TextPayload):
            if self.prepare_s_per_char:
                time.sleep(self.prepare_s_per_char * sum(len(text) for text in payload.texts))
            return [_text_item(text, self.max_len) for text in payload.texts]
        array = fp32_rows(payload, self.max_len)
        return [PreparedItem(cost=array.shape[1], data=row) for row in array]

    def run_batch(self, items: Sequence[PreparedItem]) -> list[np.ndarray | ItemFailure]:
        longest = max(item.cost for item in items)
        seconds = self.alpha_s + self.beta_s * len(items) * longest / self.ref_len
        if self.jitter:
            seconds *= max(0.0, 1.0 + self._rng.uniform(-self.jitter, self.jitter))
        deadline = time.perf_counter() + seconds
        outputs = [self._compute(item) for item in items]
        left = deadline - time.perf_counter() - _SPIN_S
        if left > 0:
            time.sleep(left)  # wakes 50-150 us late here: sleep short of the deadline...
        while time.perf_counter() < deadline:  # ...and spin the rest, so a batch takes its modelled time
            time.sleep(0)  # lets the event loop's thread take the GIL meanwhile
        return outputs

    def pack(self, outputs: Sequence[np.ndarray]) -> wire.Payload:
        return stack_rows(outputs)

    def close(self) -> None:
        pass

    def _compute(self, item: PreparedItem) -> np.ndarray | ItemFailure:
        if self.error_rate and self._rng.random() < self.error_rate:
            return ItemFailure("injected device fault (emulator error_rate)", is_transient=True)
        if isinstance(item.data, str):
            digest = hashlib.blake2b(item.data.encode(), digest_size=4 * self.dims).digest()
            vector = np.frombuffer(digest, dtype=np.uint32).astype(np.float32) - 2**31
            return vector / np.linalg.norm(vector)
        row: np.ndarray = item.data
        total = row.sum(dtype=np.float32)
        if not np.isfinite(total):
            return ItemFailure("input row contains NaN or infinite values")
        return np.asarray(total, dtype=np.float32)


def _text_item(text: str, max_len: int) -> PreparedItem:
    num_tokens = max(1, len(text.split()))
    if num_tokens > max_len:
        raise InvalidInput(f"input has {num_tokens} tokens, more than the model's {max_len}")
    return PreparedItem(cost=num_tokens, data=text, num_tokens=num_tokens)


"""Replica choice, pure policy: power of two choices over predicted wait, prefix affinity, and
ejection of replicas whose device keeps failing.

Each candidate's predicted wait is the work ahead its worker last reported plus an estimate of
what this gateway has sent it since that report. Two candidates are sampled and the less loaded
one wins, which avoids the herding that "always the least loaded" causes when reports are stale.

*Prefix affinity* (generative models). A worker's engine keeps the KV blocks of the prompts it
computed (its prefix cache), so a prompt that shares a prefix with one a worker saw recently
(a system prompt, the earlier turns of a conversation) costs that worker only its new tokens.
`PrefixAffinity` remembers which worker last took each prompt prefix and sends a prompt to the
worker that took its longest known prefix, unless that worker's predicted wait is more than
`slack_s` above the least loaded candidate's; otherwise the choice is by load, as above. A
prefix is a chain of hashes over the prompt's first `max_blocks` blocks of `block_bytes` bytes,
started from a scope (tenant, model, version, and the request's `cache_salt`: `affinity_scope`):
the workers salt their prefix caches per tenant and `cache_salt`, so one tenant's prompts never
route by another's, nor a salt's by another salt's. Each gateway keeps its own table (several
gateways may send one prefix to different workers; each then keeps sending it to its own).

    prompt bytes  [  block 0  ][  block 1  ][  block 2  ][ ...      key_i = H(key_{i-1} || block i)
    keys            k0 ──────▶ k1 ──────▶ k2                       key_-1 = H(scope)
    owner table     k0 → w1    k1 → w1    k2 → w0                  (bounded, least recently used out)
    this prompt's longest known run: k0 k1 k2 → w0

*Ejection* (as Envoy's outlier detection does it). A replica whose device failed `threshold`
requests of a model in a row (transient device faults, not the inputs' errors) gets none of that
model's requests for `eject_s` while another replica serves it, twice as long after each
ejection in a row (up to `max_eject_s`); then it is back, and one success resets it. The gateway
sends a request that failed so to another replica (`Dispatcher.dispatch`), so a broken device
costs its clients a retry's latency, not an error.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from sluice import wire

__all__ = ["Candidate", "Ejections", "PrefixAffinity", "affinity_scope", "choose", "prompt_bytes"]


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


def prompt_bytes(payload: wire.Payload, limit: int) -> bytes | None:
    """At least the first `limit` bytes of what a generation's prompt starts with (all of it if
    shorter); None for any other payload. Chat: the tools, then each message, as JSON (an
    earlier turn's encoding is a prefix of the next's)."""
    if not isinstance(payload, wire.GeneratePayload):
        return None
    if payload.prompt is not None:
        return payload.prompt[:limit].encode()  # a character is at least one byte
    if payload.prompt_token_ids is not None:
        return array("q", payload.prompt_token_ids[:-(-limit // 8)]).tobytes()
    if payload.messages is not None:
        parts = [msgspec.json.encode(payload.tools)]
        size = len(parts[0])
        for message in payload.messages:
            if size >= limit:
                break
            parts.append(msgspec.json.encode(message))
            size += len(parts[-1])
        return b"".join(parts)
    return None


def affinity_scope(tenant: str, model: str, version: str, payload: wire.Payload) -> str:
    """What a generation's prefix keys start from: the scope of the worker's prefix cache it can
    hit, i.e. its tenant and its own `cache_salt` (vLLM's; the worker's salt is both), and the
    replica's model and version. Requests with different salts share no cached blocks, so they
    must not follow each other's prefixes; those with the same salt do."""
    scope = f"{tenant}\0{model}\0{version}"
    if isinstance(payload, wire.GeneratePayload) and payload.cache_salt:
        scope += f"\0{payload.cache_salt}"
    return scope


class PrefixAffinity:
    def __init__(self, *, block_bytes: int = 64, max_blocks: int = 64, slack_s: float = 0.05,
                 capacity: int = 1 << 16) -> None:
        self.block_bytes = block_bytes
        self.max_blocks = max_blocks
        self.slack_s = slack_s
        self.capacity = capacity
        self._owner: OrderedDict[bytes, str] = OrderedDict()

    @property
    def max_bytes(self) -> int:
        """How much of a prompt's start its keys cover."""
        return self.block_bytes * self.max_blocks

    def keys(self, scope: str, prompt: bytes) -> list[bytes]:
        """The chain keys of `prompt`'s full blocks (at most `max_blocks`)."""
        key = hashlib.blake2b(scope.encode(), digest_size=16).digest()
        keys = []
        size = self.block_bytes
        for start in range(0, min(len(prompt) // size, self.max_blocks) * size, size):
            key = hashlib.blake2b(key + prompt[start:start + size], digest_size=16).digest()
            keys.append(key)
        return keys

    def owner(self, keys: Sequence[bytes]) -> str | None:
        """The worker that took this prompt's longest known prefix."""
        found = None
        for key in keys:
            worker_id = self._owner.get(key)
            if worker_id is None:
                break
            found = worker_id
        return found

    def choose(self, candidates: Sequence[Candidate], keys: Sequence[bytes], rng: random.Random,
               ) -> tuple[Candidate | None, bool]:
        """The replica for a prompt with these keys, and whether affinity chose it (rather than load)."""
        if len(candidates) > 1 and keys:
            owner = self.owner(keys)
            if owner is not None:
                least = min(c.predicted_wait_s for c in candidates)
                for candidate in candidates:
                    if candidate.worker_id == owner and candidate.predicted_wait_s <= least + self.slack_s:
                        return candidate, True
        return choose(candidates, rng), False

    def record(self, keys: Sequence[bytes], worker_id: str) -> None:
        """The prompt with these keys went to `worker_id`: its prefixes are cached there now."""
        owners = self._owner
        for key in keys:
            owners[key] = worker_id
            owners.move_to_end(key)
        while len(owners) > self.capacity:
            owners.popitem(last=False)


ReplicaKey = tuple[str, str, str]
"""(worker id, model, version)."""


@dataclass(slots=True)
class _Failing:
    """A replica that has failed since its last success."""

    failures: int = 0
    """Failures in a row since it was last ejected (or first failed)."""
    ejections: int = 0
    """Ejections in a row: each lasts twice the one before."""
    until: float = 0.0
    """Ejected until then."""


class Ejections:
    def __init__(self, *, threshold: int = 5, eject_s: float = 5.0, max_eject_s: float = 60.0) -> None:
        if threshold < 1 or not 0 < eject_s <= max_eject_s:
            raise ValueError("need threshold >= 1 and 0 < eject_s <= max_eject_s")
        self.threshold = threshold
        self.eject_s = eject_s
        self.max_eject_s = max_eject_s
        self._failing: dict[ReplicaKey, _Failing] = {}

    @property
    def is_clear(self) -> bool:
        """No replica has failed since its last success: nothing to record for a success, nobody to leave out."""
        return not self._failing

    def is_ejected(self, key: ReplicaKey, now: float) -> bool:
        failing = self._failing.get(key)
        return failing is not None and now < failing.until

    def failed(self, key: ReplicaKey, now: float) -> float:
        """A request failed on this replica's device: the seconds it is now ejected for (0: not ejected)."""
        failing = self._failing.setdefault(key, _Failing())
        failing.failures += 1
        if failing.failures < self.threshold:
            return 0.0
        duration_s = min(self.eject_s * 2 ** failing.ejections, self.max_eject_s)
        failing.failures, failing.ejections, failing.until = 0, failing.ejections + 1, now + duration_s
        return duration_s

    def known(self, now: float) -> dict[ReplicaKey, bool]:
        """Every replica that has failed since its last success: whether it is ejected now."""
        return {key: now < failing.until for key, failing in self._failing.items()}

    def succeeded(self, key: ReplicaKey) -> None:
        self._failing.pop(key, None)

    def healthy(self, candidates: Sequence[Candidate], model: str, version: str, now: float) -> Sequence[Candidate]:
        """The candidates not ejected for this model, or all of them if every one is."""
        if len(candidates) < 2 or self.is_clear:
            return candidates
        kept = [c for c in candidates if not self.is_ejected((c.worker_id, model, version), now)]
        return kept or candidates

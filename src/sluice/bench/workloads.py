"""Request bodies for the load generator, encoded once before a run starts.

A `Workload` is everything the sender needs: one URL, fixed headers and a small pool of
pre-encoded body templates that requests cycle through, so that no JSON is built while sending.
Each template is split around one slot where the request's index goes (the first number of a
tensor, or a tag at the end of a sentence), so every request is distinct and a result cache
cannot answer it: the benchmark measures the device path. Each workload also carries a mark of
its own run (a tensor's second number, or a tag in the sentence, drawn at random when it is
built), so that neither can a cache that kept the answers of an earlier run against the same
server.

    kserve      POST {url}/v2/models/{model}/infer
                {"inputs": [{"name": <from metadata>, "shape": [1, L], "datatype": "FP32", "data": [...]}]}
                (a BYTES input gets one sentence instead: shape [1], data ["..."]; a model of
                several inputs gets each as its metadata describes it: `kserve_templates`)
    embeddings  POST {url}/v1/embeddings   {"model": m, "input": "<sentence>"}

Sentences are built in code from a few word lists, so runs need no downloads and are repeatable.
"""

from __future__ import annotations

import itertools
import random
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgspec
import numpy as np

NUM_BODIES = 64
TIMEOUT_HEADER = "X-Request-Timeout-Ms"

_SUBJECTS = ("The quick brown fox", "A tired engineer", "Our new scheduler", "The small robot",
             "A curious student", "The night train", "My neighbour's cat", "The old lighthouse")
_VERBS = ("jumps over", "carefully reviews", "quietly watches", "slowly rebuilds",
          "happily explains", "never forgets")
_OBJECTS = ("the lazy dog.", "a pull request before lunch.", "the batches waiting in its queue.",
            "a broken bicycle in the garage.", "why the sky looks blue at noon.",
            "the first snow of the winter.", "every deadline it has ever missed.")


class Endpoint(StrEnum):
    """Which wire protocol the generator speaks."""

    KSERVE = "kserve"
    """Open Inference Protocol v2 tensor inference."""
    EMBEDDINGS = "embeddings"
    """OpenAI-compatible `/v1/embeddings`."""


@dataclass(frozen=True, slots=True)
class LengthRange:
    """Token counts drawn uniformly from [low, high] (inclusive); low == high is a fixed length."""

    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


def parse_length(text: str) -> LengthRange:
    """`"64"` or `"32:256"` -> a LengthRange; ValueError for anything else."""
    parts = text.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        raise ValueError(f"not a length or a low:high range: {text!r}") from None
    if len(parts) > 2 or low < 1 or high < low:
        raise ValueError(f"not a length or a low:high range with 1 <= low <= high: {text!r}")
    return LengthRange(low, high)


def lengths_of(input_len: int | LengthRange, count: int, seed: int) -> list[int]:
    """`count` lengths: `input_len` each, or drawn uniformly from its range (repeatably)."""
    if isinstance(input_len, int):
        if input_len < 1:
            raise ValueError(f"input length must be at least 1, got {input_len}")
        return [input_len] * count
    rng = random.Random(seed)
    return [input_len.draw(rng) for _ in range(count)]


@dataclass(frozen=True, slots=True)
class InputSpec:
    """An input of a KServe model, as its metadata describes it."""

    name: str
    datatype: str
    shape: tuple[int, ...] | None = None
    """The batch dimension first; -1: variable (a body gives it the run's input length). None:
    not known, taken as `[-1, -1]` for numbers (the emulator's rows) and `[-1]` for BYTES (texts)."""

    @property
    def dims(self) -> tuple[int, ...]:
        return self.shape or ((-1,) if self.datatype == "BYTES" else (-1, -1))


@dataclass(frozen=True, slots=True)
class BodyTemplate:
    """A pre-encoded body with one slot: `prefix + str(index) + suffix`."""

    prefix: bytes
    suffix: bytes
    has_slot: bool = True

    def render(self, index: int) -> bytes:
        return self.prefix + str(index).encode() + self.suffix if self.has_slot else self.prefix


@dataclass(frozen=True, slots=True)
class Workload:
    url: str
    headers: dict[str, str]
    templates: tuple[BodyTemplate, ...]
    description: str

    def body(self, index: int) -> bytes:
        """The body of request number `index`: cheap (two concatenations), distinct per index."""
        return self.templates[index % len(self.templates)].render(index)


def sentences(count: int) -> list[str]:
    """`count` varied short sentences, the same on every call."""
    combos = itertools.product(_SUBJECTS, _VERBS, _OBJECTS)
    # Stride through the combinations so consecutive sentences differ in every part.
    pool = list(combos)
    stride = 37  # coprime with len(pool) = 336
    return [" ".join(pool[(i * stride) % len(pool)]) for i in range(count)]


def input_specs_from_metadata(metadata: dict[str, Any]) -> tuple[InputSpec, ...]:
    """Every input of a KServe model (several for the `onnx` and `python` kinds), as its metadata
    describes it."""
    try:
        specs = tuple(InputSpec(str(entry["name"]), str(entry["datatype"]), tuple(int(d) for d in entry["shape"]))
                      for entry in metadata["inputs"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"model metadata has no usable inputs: {metadata!r}") from exc
    if not specs:
        raise ValueError(f"model metadata has no usable inputs: {metadata!r}")
    return specs


def kserve_templates(specs: tuple[InputSpec, ...], input_len: int | LengthRange, num_bodies: int = NUM_BODIES,
                     seed: int = 0, run_mark: int = 0) -> tuple[tuple[BodyTemplate, ...], bool]:
    """Bodies for a model's inputs: one row each, its variable dimensions `input_len` long;
    numbers random for floating-point inputs and 1 for integer ones (token ids, masks), a
    sentence for BYTES. The slot and the run's mark (below 2**20) go into the first
    floating-point or BYTES input; the second value says whether there is none (integer inputs
    only), so that the bodies repeat and the cache must be skipped by header instead."""
    lengths = lengths_of(input_len, num_bodies, seed)
    rng = np.random.default_rng(seed)
    texts = sentences(num_bodies)
    slotted = next((spec.name for spec in specs if spec.datatype == "BYTES" or spec.datatype.startswith("FP")), None)
    docs = []
    for number in range(num_bodies):
        inputs = []
        for spec in specs:
            shape = [1, *(lengths[number] if d < 0 else d for d in spec.dims[1:])]
            count = int(np.prod(shape))
            data: list[Any]
            if spec.datatype == "BYTES":
                data = [_tagged(texts[number], run_mark) if spec.name == slotted else texts[number]] * count
            elif spec.datatype.startswith("FP"):
                data = rng.random(count).round(4).tolist()
                if spec.name == slotted:
                    data[0] = _SLOT
                    if count > 1:  # (a one-value tensor holds only the index)
                        data[1] = run_mark / 2**20  # exact in FP32: 20 bits of fraction
            else:
                data = [True] * count if spec.datatype == "BOOL" else [1] * count
            inputs.append({"name": spec.name, "shape": shape, "datatype": spec.datatype, "data": data})
        docs.append({"inputs": inputs})
    if slotted is None:
        return tuple(_template(doc, None) for doc in docs), True
    is_text = next(spec for spec in specs if spec.name == slotted).datatype == "BYTES"
    return tuple(_template(doc, _SLOT if is_text else f'"{_SLOT}"') for doc in docs), False


def embeddings_templates(model: str, num_bodies: int = NUM_BODIES, run_mark: int = 0) -> tuple[BodyTemplate, ...]:
    return tuple(_template({"model": model, "input": _tagged(text, run_mark)}, _SLOT)
                 for text in sentences(num_bodies))


_SLOT = "@@SLUICE_BENCH_SLOT@@"


def _tagged(text: str, run_mark: int) -> str:
    return f"{text} (run {run_mark}, request {_SLOT})"


def _template(doc: dict[str, Any], marker: str | None) -> BodyTemplate:
    """`doc` encoded, split around `marker` (None: a body without a slot, the same each time)."""
    if marker is None:
        return BodyTemplate(msgspec.json.encode(doc), b"", has_slot=False)
    prefix, suffix = msgspec.json.encode(doc).split(marker.encode())
    return BodyTemplate(prefix, suffix)


def build_workload(endpoint: Endpoint, base_url: str, model: str, input_len: int | LengthRange,
                   timeout_ms: float | None,
                   spec: InputSpec | tuple[InputSpec, ...] | None = None, seed: int = 0,
                   extra_headers: Mapping[str, str] | None = None, run_mark: int | None = None) -> Workload:
    """The workload for one endpoint. KServe needs the model's inputs (`input_specs_from_metadata`).

    `extra_headers` go on every request (an API key, a priority class). `run_mark` (below
    2**20; drawn at random when not given) makes the bodies differ from another run's.
    """
    run_mark = secrets.randbelow(2**20) if run_mark is None else run_mark
    base_url = base_url.rstrip("/")
    headers = {"Content-Type": "application/json", **(extra_headers or {})}
    if timeout_ms is not None:
        if timeout_ms <= 0:
            raise ValueError(f"timeout must be positive, got {timeout_ms} ms")
        headers[TIMEOUT_HEADER] = f"{timeout_ms:g}"
    if endpoint is Endpoint.KSERVE:
        if spec is None:
            raise ValueError("a kserve workload needs the model's input spec")
        specs = spec if isinstance(spec, tuple) else (spec,)
        templates, repeats = kserve_templates(specs, input_len, seed=seed, run_mark=run_mark)
        if repeats:  # integer inputs only: no slot to make bodies distinct
            headers["Cache-Control"] = "no-cache"
        shapes = ", ".join(f"{s.name} {s.datatype} {[1, *('L' if d < 0 else d for d in s.dims[1:])]}"
                           for s in specs).replace("'", "")
        varies = any(d < 0 for s in specs for d in s.dims[1:])
        return Workload(f"{base_url}/v2/models/{model}/infer", headers, templates,
                        f"kserve {model} {shapes}" + (f", L = {input_len}" if varies else ""))
    return Workload(f"{base_url}/v1/embeddings", headers, embeddings_templates(model, run_mark=run_mark),
                    f"embeddings {model}")

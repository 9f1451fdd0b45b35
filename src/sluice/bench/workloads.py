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
                (a BYTES input gets one sentence instead: shape [1], data ["..."])
    embeddings  POST {url}/v1/embeddings   {"model": m, "input": "<sentence>"}

Sentences are built in code from a few word lists, so runs need no downloads and are repeatable.
"""

from __future__ import annotations

import itertools
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
class InputSpec:
    """The first input of a KServe model, as its metadata describes it."""

    name: str
    datatype: str


@dataclass(frozen=True, slots=True)
class BodyTemplate:
    """A pre-encoded body with one slot: `prefix + str(index) + suffix`."""

    prefix: bytes
    suffix: bytes

    def render(self, index: int) -> bytes:
        return self.prefix + str(index).encode() + self.suffix


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


def input_spec_from_metadata(metadata: dict[str, Any]) -> InputSpec:
    """The first input's name and datatype from a KServe model metadata document."""
    try:
        first = metadata["inputs"][0]
        return InputSpec(name=str(first["name"]), datatype=str(first["datatype"]))
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"model metadata has no usable inputs[0]: {metadata!r}") from exc


def kserve_templates(spec: InputSpec, input_len: int, num_bodies: int = NUM_BODIES,
                     seed: int = 0, run_mark: int = 0) -> tuple[BodyTemplate, ...]:
    """Bodies for a KServe input; `run_mark` (below 2**20) tells this run's bodies from another's."""
    if spec.datatype == "BYTES":
        docs = [{"inputs": [{"name": spec.name, "shape": [1], "datatype": "BYTES",
                             "data": [_tagged(text, run_mark)]}]} for text in sentences(num_bodies)]
        return tuple(_template(doc, _SLOT) for doc in docs)
    if input_len < 1:
        raise ValueError(f"input length must be at least 1, got {input_len}")
    rng = np.random.default_rng(seed)
    rows = rng.random((num_bodies, input_len)).round(4).tolist()
    if input_len > 1:  # (a one-value tensor holds only the index)
        for row in rows:
            row[1] = run_mark / 2**20  # exact in FP32: 20 bits of fraction
    docs = [{"inputs": [{"name": spec.name, "shape": [1, input_len], "datatype": spec.datatype,
                         "data": [_SLOT, *row[1:]]}]} for row in rows]
    return tuple(_template(doc, f'"{_SLOT}"') for doc in docs)


def embeddings_templates(model: str, num_bodies: int = NUM_BODIES, run_mark: int = 0) -> tuple[BodyTemplate, ...]:
    return tuple(_template({"model": model, "input": _tagged(text, run_mark)}, _SLOT)
                 for text in sentences(num_bodies))


_SLOT = "@@SLUICE_BENCH_SLOT@@"


def _tagged(text: str, run_mark: int) -> str:
    return f"{text} (run {run_mark}, request {_SLOT})"


def _template(doc: dict[str, Any], marker: str) -> BodyTemplate:
    prefix, suffix = msgspec.json.encode(doc).split(marker.encode())
    return BodyTemplate(prefix, suffix)


def build_workload(endpoint: Endpoint, base_url: str, model: str, input_len: int, timeout_ms: float | None,
                   spec: InputSpec | None = None, seed: int = 0,
                   extra_headers: Mapping[str, str] | None = None, run_mark: int | None = None) -> Workload:
    """The workload for one endpoint. KServe needs the model's `spec` (see `input_spec_from_metadata`).

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
        shape = "" if spec.datatype == "BYTES" else f" [1, {input_len}]"
        templates = kserve_templates(spec, input_len, seed=seed, run_mark=run_mark)
        return Workload(f"{base_url}/v2/models/{model}/infer", headers, templates,
                        f"kserve {model} {spec.name} {spec.datatype}{shape}")
    return Workload(f"{base_url}/v1/embeddings", headers, embeddings_templates(model, run_mark=run_mark),
                    f"embeddings {model}")

"""The small protocol every runner follows, and the factory that picks one by `kind`.

A runner's life: construct (loads weights onto the device) -> `warmup()` -> many
`prepare()` (validate and cost each item: on the event loop, or for a large request on a worker
thread, alongside other `prepare` calls and `run_batch`) and `run_batch()` (device thread) ->
`close()`. `run_batch` returns one entry per item, in order: an output array, or an
`ItemFailure` for an item the model could not process. An exception from `run_batch` means the
whole batch failed; the worker then bisects the batch to isolate the poisoned item.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from sluice import wire
from sluice.errors import ConfigError, InvalidInput
from sluice.repository import ModelVersion

if TYPE_CHECKING:
    from typing_extensions import TypeIs

    from sluice.engines.generative.runner import GenerativeRunner


@dataclass(frozen=True, slots=True)
class PreparedItem:
    """One input row, ready for the device. `cost` is its length in elements or tokens."""

    cost: int
    data: Any
    num_tokens: int = 0
    trace: wire.TraceContext | None = None
    """Its request's W3C trace context (`wire.Submit.trace`), for a runner whose item is a call to
    another server (`http-single`); set by the worker after `prepare`."""


@dataclass(frozen=True, slots=True)
class ItemFailure:
    message: str
    is_transient: bool = False
    """The device failed, not the input (an upstream down, a circuit open): retrying later may
    succeed. A request whose every failed item is transient is answered 503, not 422."""


ItemOutput = Any
"""One item's result, as a runner's `run_batch` gives it and its `pack` takes it back: an array,
or for a model of several outputs (`named_tensors`) a row of each."""


def num_threads_of(version: ModelVersion) -> int | None:
    """`[params] num_threads`: a runner's intra-op threads on the CPU (None: the library's choice);
    a ConfigError for anything but a positive integer."""
    num_threads = version.params.get("num_threads")
    if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                    or num_threads < 1):
        raise ConfigError(f"{version.name}: num_threads must be a positive integer, got {num_threads!r}")
    return num_threads


def fp32_rows(payload: wire.Payload, max_len: int | None = None) -> np.ndarray:
    """A request's FP32 [batch, length] tensor as an array of rows (rows of 1 to `max_len`
    elements); `InvalidInput` for anything else."""
    if not isinstance(payload, wire.TensorPayload) or payload.dtype != "float32" or len(payload.shape) != 2:
        got = f"{payload.dtype} {list(payload.shape)}" if isinstance(payload, wire.TensorPayload) else "no tensor"
        raise InvalidInput(f"INPUT0 must be FP32 with shape [batch, length], got {got}")
    rows, length = payload.shape
    if length < 1 or (max_len is not None and length > max_len):
        allowed = "at least 1" if max_len is None else f"1 to {max_len}"
        raise InvalidInput(f"INPUT0 rows must have {allowed} elements, got {length}")
    return np.frombuffer(payload.data, dtype=np.float32).reshape(rows, length)


class Runner(Protocol):
    info: wire.ModelInfo

    def prior(self) -> tuple[float, float, float]:
        """(alpha_s, beta_s per unit of padded cost, reference cost) to seed the latency profile."""
        ...

    def warmup(self) -> list[tuple[int, float]]:
        """Run a few batches; return (padded_cost, seconds) for each, to fit the profile."""
        ...

    def prepare(self, payload: wire.Payload) -> list[PreparedItem]:
        """Split a request into items. Raises `InvalidInput` if the request as a whole is malformed.
        Must be safe to call from several threads at once (it may run while `run_batch` does)."""
        ...

    def run_batch(self, items: Sequence[PreparedItem]) -> list[ItemOutput | ItemFailure]:
        """Execute on the device. Called from the device thread only."""
        ...

    def pack(self, outputs: Sequence[ItemOutput]) -> wire.Payload:
        """Assemble a request's item outputs into its response payload."""
        ...

    def close(self) -> None: ...


Share = tuple[int, int]
"""(index, count): this worker is worker `index` of `count` serving the same repository, and
takes that part of each external upstream's concurrency (`share_of`)."""


def share_of(total: int, share: Share) -> int:
    """Worker `index` of `count`'s part of a concurrency limit of `total` calls: the parts add
    up to `total` (never below 1 each, so more workers than calls slightly exceed it)."""
    index, count = share
    return max(total // count + (1 if index < total % count else 0), 1)


TORCH_KINDS = frozenset({"generative", "embedding"})
"""Runner kinds built on torch (a `python` model may import it itself)."""


def is_generative(runner: object) -> TypeIs[GenerativeRunner]:
    """Whether `runner` is a generative model's engine, without importing the engine: it brings
    torch (2-3 s of a worker's start), which a worker that serves no generative model never needs.
    No runner can be one before `load_runner` has imported the module."""
    module = sys.modules.get("sluice.engines.generative.runner")
    return module is not None and isinstance(runner, module.GenerativeRunner)


def load_runner(version: ModelVersion, device: str, share: Share = (0, 1)) -> Runner:
    """`share`: for runners whose device is an external server, this worker's part of its limits."""
    if version.kind == "emulated":
        from sluice.engines.emulated import EmulatedRunner

        return EmulatedRunner(version, device)
    if version.kind == "embedding":
        from sluice.engines.embedding import EmbeddingRunner

        return EmbeddingRunner(version, device)
    if version.kind == "generative":
        from sluice.engines.generative.runner import GenerativeRunner

        return GenerativeRunner(version, device)  # type: ignore[return-value]  # not a one-shot Runner
    if version.kind == "openai-upstream":
        from sluice.engines.openai_upstream import OpenAIUpstreamRunner

        return OpenAIUpstreamRunner(version, device, share)  # type: ignore[return-value]  # not a one-shot Runner
    if version.kind == "http-single":
        from sluice.engines.http_single import HttpSingleRunner

        return HttpSingleRunner(version, device, share)
    if version.kind == "onnx":
        from sluice.engines.onnx_runtime import OnnxRunner

        return OnnxRunner(version, device)
    if version.kind == "python":
        from sluice.engines.python_model import PythonModelRunner

        return PythonModelRunner(version, device)
    raise ConfigError(f"unknown runner kind {version.kind!r}")


def rows_model_info(version: ModelVersion) -> wire.ModelInfo:
    """The interface of a runner that takes FP32 rows `INPUT0 [n, L]` (or texts) and gives one
    output per row, `OUTPUT0`: the emulated and http-single runners."""
    return wire.ModelInfo(
        name=version.name,
        version=version.version,
        kind=version.kind,
        platform=version.platform,
        inputs=(wire.TensorSpec("INPUT0", "FP32", (-1, -1)),),
        outputs=(wire.TensorSpec("OUTPUT0", "FP32", (-1,)),),
        max_batch_size=version.batching.max_batch_size,
        max_batch_cost=version.batching.max_batch_cost,
        slo_s=version.slo_s,
        accepts_text=True,
        accepts_tensor=True,
        cache_revision=version.cache_revision,
    )


def stack_rows(outputs: Sequence[np.ndarray]) -> wire.TensorPayload:
    """Items' outputs (arrays of one shape and dtype) as one tensor, the items its first dimension."""
    if not outputs:
        return wire.TensorPayload(dtype="float32", shape=(0,), data=b"")
    first = outputs[0]
    if any(output.shape != first.shape or output.dtype != first.dtype for output in outputs):
        array = np.stack(outputs)  # one dtype for all; outputs of different shapes are a runner's bug
        return wire.TensorPayload(dtype=array.dtype.name, shape=array.shape, data=array.tobytes())
    # joined rather than np.stack-ed: with caches cold (a lone request's answer) this costs a
    # fraction of numpy's several calls
    return wire.TensorPayload(dtype=first.dtype.name, shape=(len(outputs), *first.shape),
                              data=b"".join(output.tobytes() for output in outputs))

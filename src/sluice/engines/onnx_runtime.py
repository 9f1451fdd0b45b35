"""Runner kind `onnx`: an ONNX model on ONNX Runtime, CPU or CUDA.

The version folder holds `model.onnx` (another name with `[params] file`). Its inputs and
outputs, names, datatypes and shapes come from the graph; each must have a variable first
dimension, the batch (export with `dynamic_axes` / `dynamic_shapes`), or 1: a graph exported
for one row is served one row per call (requests give its shapes as they are). Settings (`[params]`):
`num_threads` (intra-op threads; default ONNX Runtime's), `spin` (let idle intra-op threads
spin-wait; default false, so an idle model leaves the cores to the rest of the server),
`optimization` (`all`, `extended`, `basic` or `none`; default `all`), `pad` (inputs whose rows
of different lengths share a call, padded: `named_tensors`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from sluice import wire
from sluice.engines.base import num_threads_of
from sluice.engines.named_tensors import NamedTensorRunner, named_io_info, zeros_row
from sluice.errors import ConfigError
from sluice.repository import ModelVersion

log = logging.getLogger(__name__)

_DATATYPES = {
    "tensor(bool)": "BOOL", "tensor(uint8)": "UINT8", "tensor(uint16)": "UINT16", "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64", "tensor(int8)": "INT8", "tensor(int16)": "INT16", "tensor(int32)": "INT32",
    "tensor(int64)": "INT64", "tensor(float16)": "FP16", "tensor(float)": "FP32", "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}
_OPTIMIZATION = ("all", "extended", "basic", "none")


class OnnxRunner(NamedTensorRunner):
    def __init__(self, version: ModelVersion, device: str) -> None:
        self._session: Any = onnx_session(version, version.weights_dir / str(version.params.get("file", "model.onnx")),
                                          device)
        self.device = device
        self.info = named_io_info(version, [_spec(v, version, "input") for v in self._session.get_inputs()],
                                  [_spec(v, version, "output") for v in self._session.get_outputs()])
        self._output_names = [spec.name for spec in self.info.outputs]
        # a graph exported for one row ([1, ...]): served one row per call, as Triton serves a
        # model with max_batch_size 0 (each request gives the shape as it is, batch dimension 1)
        self.one_row_per_call = any(spec.shape[0] == 1 for spec in self.info.inputs)
        self.read_padding(version)
        self._strings = {spec.name for spec in self.info.inputs if spec.datatype == "BYTES"}

    def warmup(self) -> list[tuple[int, float]]:
        """Batches of zeros with each variable dimension 1; a model that refuses them (it needs
        other sizes or values) is warmed up by its first requests instead."""
        try:
            return self.timed_warmup(zeros_row(self.info.inputs))
        except Exception as exc:
            log.warning("%s v%s: warm-up with zeros failed (%s); the first requests will warm it up",
                        self.info.name, self.info.version, exc)
            return []

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        feed = {name: (np.vectorize(bytes.decode, otypes=[object])(array) if name in self._strings else array)
                for name, array in inputs.items()}
        return dict(zip(self._output_names, self._session.run(self._output_names, feed), strict=True))

    def close(self) -> None:
        self._session = None


def onnx_session(version: ModelVersion, path: Path, device: str) -> Any:
    """An ONNX Runtime session of `path` on `device`, with the version's `[params]` settings
    (`num_threads`, `spin`, `optimization`); a ConfigError naming what is wrong."""
    import onnxruntime  # type: ignore[import-untyped]

    params = version.params
    if not path.is_file():
        raise ConfigError(f"{version.name} v{version.version}: no ONNX file {path}")
    options = onnxruntime.SessionOptions()
    num_threads = num_threads_of(version)
    if num_threads is not None:
        options.intra_op_num_threads = num_threads
    if not params.get("spin", False):
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    level = params.get("optimization", "all")
    if level not in _OPTIMIZATION:
        raise ConfigError(f"{version.name}: optimization must be one of {', '.join(_OPTIMIZATION)}, got {level!r}")
    options.graph_optimization_level = {
        "all": onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL,
        "extended": onnxruntime.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "basic": onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "none": onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL,
    }[level]
    try:
        return onnxruntime.InferenceSession(str(path), options, providers=_providers(device))
    except Exception as exc:  # onnxruntime raises its own types for a file it cannot load
        raise ConfigError(f"{version.name} v{version.version}: ONNX Runtime cannot load {path.name}: {exc}") from exc


def _providers(device: str) -> list[Any]:
    import onnxruntime

    if not device.startswith("cuda"):
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        raise ConfigError(f"device {device} needs ONNX Runtime's CUDA provider: install onnxruntime-gpu "
                          "in place of onnxruntime")
    device_id = int(device.partition(":")[2] or 0)
    return [("CUDAExecutionProvider", {"device_id": device_id}), "CPUExecutionProvider"]


def _spec(value: Any, version: ModelVersion, role: str) -> wire.TensorSpec:
    datatype = _DATATYPES.get(value.type)
    if datatype is None:
        raise ConfigError(f"{version.name} v{version.version}: {role} {value.name!r} is {value.type}, "
                          f"which sluice does not serve (it serves {', '.join(_DATATYPES)})")
    shape = [d if isinstance(d, int) and d >= 0 else -1 for d in value.shape]
    if not shape or shape[0] not in (-1, 1):
        raise ConfigError(f"{version.name} v{version.version}: {role} {value.name!r} has shape {value.shape}: "
                          "its first dimension must be variable (the batch) or 1 (one row per call); export "
                          "the model with a dynamic batch axis")
    return wire.TensorSpec(value.name, datatype, tuple(shape))

"""Runner kind `python`: a model written in Python, in the version folder's `model.py`.

`model.py` defines a class `Model` (another name with `[params] class`):

    class Model:
        def __init__(self, path: pathlib.Path, device: str, params: dict): ...
            # load from `path` (the version folder) onto `device` ("cpu", "cuda:0"); `params` is
            # model.toml's [params]
        def predict(self, inputs: dict[str, numpy.ndarray]) -> dict[str, numpy.ndarray]: ...
            # a batch: each input's first dimension is the batch's items; give each output with
            # as many rows. BYTES tensors are object arrays of `bytes` (`str` accepted back).
        def warmup(self) -> None: ...   # optional: run once after loading, before serving
        def close(self) -> None: ...    # optional: release what it holds

Its inputs and outputs are declared in `model.toml` (`[[inputs]]`, `[[outputs]]`). The version
folder is imported as a package of its own, so `model.py` reaches the folder's other files with
relative imports (`from .features import encode`). `predict` runs on the worker's device thread,
one batch at a time. An exception fails the batch, and the worker then runs its items apart so
that only the ones that raise fail. `model.py` is listed in
the version's `SHA256SUMS` like any weight file, so code that changed is refused, not run.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from typing import Any

import numpy as np

from sluice.engines.named_tensors import NamedTensorRunner, named_io_info
from sluice.errors import ConfigError
from sluice.repository import ModelVersion


class PythonModelRunner(NamedTensorRunner):
    def __init__(self, version: ModelVersion, device: str) -> None:
        params = dict(version.params)
        path = version.weights_dir / str(params.get("file", "model.py"))
        class_name = str(params.get("class", "Model"))
        where = f"{version.name} v{version.version}"
        if not path.is_file():
            raise ConfigError(f"{where}: no {path.name} in {version.weights_dir}")
        # The version folder is a package of its own (a name per version and revision), and
        # model.py its module `model`: relative imports (`from .helpers import f`) reach the
        # folder's other files, and two versions' files never share a module.
        package = "sluice_model_" + re.sub(r"\W", "_", f"{version.name}_{version.version}_{version.revision}")
        spec = importlib.util.spec_from_file_location(f"{package}.{path.stem}", path)
        if spec is None or spec.loader is None:
            raise ConfigError(f"{where}: {path.name} cannot be imported")
        folder = types.ModuleType(package)
        folder.__path__ = [str(path.parent)]
        sys.modules[package] = folder
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        self._package = package
        try:
            spec.loader.exec_module(module)
            model_class = getattr(module, class_name, None)
            if not isinstance(model_class, type):
                raise ConfigError(f"{where}: {path.name} defines no class {class_name!r}")
            self._model: Any = model_class(version.weights_dir, device, params)
        except ConfigError:
            self._forget_modules()
            raise
        except Exception as exc:  # the user's code failed to load: refuse this version alone
            self._forget_modules()
            raise ConfigError(f"{where}: loading {path.name} failed: {type(exc).__name__}: {exc}") from exc
        if not callable(getattr(self._model, "predict", None)):
            self._forget_modules()
            raise ConfigError(f"{where}: {class_name} has no predict(inputs) method")
        self.device = device
        self.info = named_io_info(version, version.inputs, version.outputs)
        self.read_padding(version)

    def warmup(self) -> list[tuple[int, float]]:
        warmup = getattr(self._model, "warmup", None)
        if callable(warmup):
            warmup()
        return []

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        answer: dict[str, Any] = self._model.predict(inputs)
        return answer

    def close(self) -> None:
        close = getattr(self._model, "close", None)
        if callable(close):
            close()
        self._model = None
        self._forget_modules()

    def _forget_modules(self) -> None:
        """Drop the version's modules (model.py and what it imported from its folder)."""
        for name in [name for name in sys.modules if name == self._package or name.startswith(self._package + ".")]:
            del sys.modules[name]

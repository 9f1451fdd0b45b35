"""Users' own models for tests: a small ONNX graph and a `model.py`, written into a repository
with their SHA256SUMS as a user would (`sluice models manifest`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sluice.repository import MANIFEST, write_manifest

SCORER_WEIGHTS = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
"""The ONNX scorer's `scores = features @ SCORER_WEIGHTS + offset`."""


def write_onnx_scorer(repo: Path, name: str = "scorer", max_batch_size: int = 32, extra: str = "") -> Path:
    """An ONNX model of three inputs and three outputs:

        features FP32 [N, 4], offset FP32 [N, 1]  -> scores FP32 [N, 3] = features @ W + offset
                                                  -> best INT64 [N]     = argmax(scores)
        ids INT64 [N, L] (L variable)              -> total INT64 [N]    = sum(ids)
                                                  -> doubled INT64 [N, L] = 2 * ids
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["features", "W"], ["product"]),
         helper.make_node("Add", ["product", "offset"], ["scores"]),
         helper.make_node("ArgMax", ["scores"], ["best"], axis=1, keepdims=0),
         helper.make_node("ReduceSum", ["ids", "axes"], ["total"], keepdims=0),
         helper.make_node("Add", ["ids", "ids"], ["doubled"])],
        "scorer",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 4]),
         helper.make_tensor_value_info("offset", TensorProto.FLOAT, ["batch", 1]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "length"])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 3]),
         helper.make_tensor_value_info("best", TensorProto.INT64, ["batch"]),
         helper.make_tensor_value_info("total", TensorProto.INT64, ["batch"]),
         helper.make_tensor_value_info("doubled", TensorProto.INT64, ["batch", "length"])],
        initializer=[numpy_helper.from_array(SCORER_WEIGHTS, "W"),
                     numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    version = repo / name / "1"
    version.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(version / "model.onnx"))
    write_manifest(version, version / MANIFEST)
    (repo / name / "model.toml").write_text(
        f'kind = "onnx"\n[batching]\nmax_batch_size = {max_batch_size}\n[slo]\ndefault_ms = 30000\n'
        f"[params]\nnum_threads = 1\n{extra}")
    return repo


def write_onnx_fixed_rows(repo: Path, rows: int, name: str = "fixed") -> Path:
    """An ONNX graph exported for a fixed number of rows: `y = relu(x)`, x and y FP32 [rows, 4]."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], name,
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, 4])])
    version = repo / name / "1"
    version.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(version / "model.onnx"))
    write_manifest(version, version / MANIFEST)
    (repo / name / "model.toml").write_text('kind = "onnx"\n[slo]\ndefault_ms = 30000\n')
    return repo


LABELLER = '''
import time

import numpy as np


class Model:
    def __init__(self, path, device, params):
        self.suffix = params.get("suffix", "!")
        self.delay_s = params.get("delay_ms", 0) / 1000
        self.warmed = False

    def warmup(self):
        self.warmed = True

    def predict(self, inputs):
        texts, x = inputs["text"], inputs["x"]
        if any(t == b"boom" for t in texts):
            raise ValueError("cannot label boom")
        time.sleep(self.delay_s)  # a call's fixed cost, as a device's
        return {
            "label": [t.decode().upper() + self.suffix for t in texts],
            "score": x.sum(axis=1),
            "batch": np.full(len(texts), len(texts), dtype=np.int64),
            "warmed": np.full(len(texts), self.warmed),
        }
'''


def write_python_labeller(repo: Path, name: str = "labeller", code: str = LABELLER, params: str = 'suffix = "!"',
                          max_batch_size: int = 32) -> Path:
    """A `python` model: `text` BYTES and `x` FP32 [2] per item -> `label` (the text upper-cased
    with a suffix), `score` (x summed), `batch` (the size of the call it ran in), `warmed`
    (whether its warmup ran). A text "boom" raises; `delay_ms` in `params` makes each call take
    that long."""
    inputs = _tensors("inputs", [("text", "BYTES", None), ("x", "FP32", [2])])
    outputs = _tensors("outputs", [("label", "BYTES", None), ("score", "FP32", None), ("batch", "INT64", None),
                                   ("warmed", "BOOL", None)])
    return _write_python_model(repo, name, code, f'kind = "python"\n[batching]\nmax_batch_size = {max_batch_size}\n'
                               f"[slo]\ndefault_ms = 30000\n[params]\n{params}\n{inputs}{outputs}")


BF16_MODEL = '''
import ml_dtypes
import numpy as np


class Model:
    def __init__(self, path, device, params):
        pass

    def predict(self, inputs):
        x = inputs["x"]
        if x.dtype != ml_dtypes.bfloat16:
            raise TypeError(f"x came as {x.dtype}")
        wide = x.astype(np.float32)
        return {"same": x, "wide": wide, "half": wide / 2}
'''


def write_python_bf16(repo: Path, name: str = "bf16") -> Path:
    """A `python` model of BF16 tensors: `x` BF16 [-1] per item (an `ml_dtypes.bfloat16` array in
    `predict`, else it raises) -> `same` (x as it came), `wide` FP32 (x's values as float32),
    `half` BF16 (x / 2, returned as float32 and rounded to the declared BF16)."""
    inputs = _tensors("inputs", [("x", "BF16", [-1])])
    outputs = _tensors("outputs", [("same", "BF16", [-1]), ("wide", "FP32", [-1]), ("half", "BF16", [-1])])
    return _write_python_model(repo, name, BF16_MODEL, 'kind = "python"\n[batching]\nmax_batch_size = 8\n'
                               f"[slo]\ndefault_ms = 30000\n{inputs}{outputs}")


def write_onnx_embedding(repo: Path, name: str = "minilm-onnx") -> Path:
    """The demo's all-MiniLM-L6-v2 as Hugging Face repositories ship an ONNX export: the
    tokenizer and configuration files beside `onnx/model.onnx`, whose output is the last hidden
    states [batch, tokens, 384] (the runner pools them); served as `kind = "embedding"` with
    `backend = "onnx"` (`benchmarks/user_models/export_minilm.py --layout hidden`)."""
    from benchmarks.user_models.export_minilm import export_minilm

    export_minilm(repo, name, layout="hidden", slo_ms=30000)
    return repo


def add_gated_version(model: Path, version: str, gate: Path, loading: str = "", blob_bytes: int = 0) -> Path:
    """A `python` model's version (`y = x`, FP32) whose `__init__` waits until the file `gate`
    exists (it touches `gate`.started first): a load that takes as long as a test wants, or hangs.
    `loading`: the model's `[loading]` table (a new model only); `blob_bytes`: a weights file that
    size in the version, for a worker's model memory budget to count."""
    if not (model / "model.toml").exists():
        model.mkdir(parents=True, exist_ok=True)
        (model / "model.toml").write_text('kind = "python"\n' + _tensors("inputs", [("x", "FP32", None)])
                                          + _tensors("outputs", [("y", "FP32", None)])
                                          + (f"[loading]\n{loading}\n" if loading else ""))
    (model / version).mkdir()
    (model / version / "model.py").write_text(
        "import time\nfrom pathlib import Path\n\nclass Model:\n"
        "    def __init__(self, path, device, params):\n"
        "        Path(params['gate'] + '.started').touch()\n"
        "        while not Path(params['gate']).exists():\n"
        "            time.sleep(0.02)\n\n"
        "    def predict(self, inputs):\n        return {'y': inputs['x']}\n")
    (model / version / "version.toml").write_text(f"[params]\ngate = '{gate}'\n")
    if blob_bytes:
        (model / version / "weights.bin").write_bytes(b"\0" * blob_bytes)
    write_manifest(model / version, model / version / MANIFEST)
    return model


def _tensors(table: str, tensors: list[tuple[str, str, list[int] | None]]) -> str:
    """model.toml's `[[inputs]]` or `[[outputs]]` (`table`) entries: one per (name, datatype,
    dims) tensor, with no `dims` where they are None."""
    return "".join(f'[[{table}]]\nname = "{name}"\ndatatype = "{datatype}"\n'
                   + ("" if dims is None else f"dims = {dims}\n") for name, datatype, dims in tensors)


def _write_python_model(repo: Path, name: str, code: str, toml: str) -> Path:
    """A `python` model's version 1 (its `model.py` and SHA256SUMS) and its model.toml."""
    version = repo / name / "1"
    version.mkdir(parents=True, exist_ok=True)
    (version / "model.py").write_text(code)
    write_manifest(version, version / MANIFEST)
    (repo / name / "model.toml").write_text(toml)
    return repo

"""Users' models on a CUDA device: a `python` model that runs PyTorch on the device it is given
answers as it does on the CPU, and an `onnx` model runs on ONNX Runtime's CUDA provider where
`onnxruntime-gpu` is installed. Skipped without a GPU (CI has none); run on one with `pytest -m gpu`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from sluice import wire
from sluice.engines import load_runner
from sluice.repository import scan_repository
from tests.user_models import SCORER_WEIGHTS, write_onnx_scorer, write_python_labeller

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TORCH_MODEL = '''
import numpy as np
import torch


class Model:
    def __init__(self, path, device, params):
        self.device = torch.device(device)
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(2, 1).to(self.device)
        self.seen_device = str(self.device)

    def predict(self, inputs):
        with torch.inference_mode():
            x = torch.from_numpy(np.ascontiguousarray(inputs["x"])).to(self.device)
            score = self.layer(x)[:, 0].float().cpu().numpy()
        n = len(inputs["text"])
        return {"label": [self.seen_device] * n, "score": score, "batch": np.full(n, n), "warmed": np.ones(n, bool)}
'''


def _answer(runner, x: np.ndarray) -> tuple[list[bytes], np.ndarray]:
    texts = np.array([b"t"] * len(x), dtype=object)
    payload = wire.TensorsPayload([
        wire.NamedTensor("text", "BYTES", texts.shape, wire.encode_bytes_elements(list(texts))),
        wire.NamedTensor("x", "FP32", x.shape, x.tobytes())])
    answer = runner.pack(runner.run_batch(runner.prepare(payload)))
    by_name = {t.name: t for t in answer.tensors}
    return wire.decode_bytes_elements(by_name["label"].data), np.frombuffer(by_name["score"].data, np.float32)


def test_a_python_model_runs_torch_on_the_device_it_is_given(tmp_path: Path):
    repo = write_python_labeller(tmp_path / "models", code=TORCH_MODEL, params="")
    version = scan_repository(repo).versions[0]
    x = np.random.default_rng(0).standard_normal((5, 2)).astype(np.float32)
    on_gpu, on_cpu = load_runner(version, "cuda:0"), load_runner(version, "cpu")
    labels, scores = _answer(on_gpu, x)
    assert labels == [b"cuda:0"] * 5
    np.testing.assert_allclose(scores, _answer(on_cpu, x)[1], rtol=1e-4, atol=1e-5)


def test_an_onnx_model_on_the_cuda_provider(tmp_path: Path):
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip("onnxruntime without its CUDA provider (install onnxruntime-gpu)")
    version = scan_repository(write_onnx_scorer(tmp_path / "models")).versions[0]
    runner = load_runner(version, "cuda:0")
    features = np.ones((3, 4), np.float32)
    payload = wire.TensorsPayload([
        wire.NamedTensor("features", "FP32", (3, 4), features.tobytes()),
        wire.NamedTensor("offset", "FP32", (3, 1), np.zeros((3, 1), np.float32).tobytes()),
        wire.NamedTensor("ids", "INT64", (3, 2), np.ones((3, 2), np.int64).tobytes())])
    answer = runner.pack(runner.run_batch(runner.prepare(payload)))
    scores = np.frombuffer(answer.tensors[0].data, np.float32).reshape(3, 3)
    np.testing.assert_allclose(scores, features @ SCORER_WEIGHTS, rtol=1e-5)

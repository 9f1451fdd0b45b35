"""A sentence-embedding runner: a BERT-style encoder on PyTorch or ONNX Runtime, CPU or CUDA.

Loads a sentence-transformers folder (all-MiniLM-L6-v2 in the demo repository) from local files
only: the encoder through `transformers.AutoModel` (or, with `backend = "onnx"`, the folder's
ONNX export, `onnx/model.onnx` as Hugging Face repositories ship it), the fast tokenizer from
`tokenizer.json` through `tokenizers`. An item is one string; its cost is its token count,
[CLS] and [SEP] included, after truncation to `max_seq_len`. An item may also come as token ids
the client made with the model's own tokenizer (`wire.TokensPayload`): they run as they are,
special tokens neither added nor cut, and more than `max_seq_len` of them are refused. A batch is
padded on the right to its longest item:

    ids   [CLS] t1 t2 t3 [SEP] [PAD] [PAD]      padded cost = n_items x longest
    mask    1   1  1  1    1     0     0         pads are neither attended to nor pooled

The embedding is the mean of the last hidden states over the mask, L2-normalised, as
sentence-transformers computes it, so padding never changes an item's vector beyond float noise.

Parameters (`[params]` in model.toml):

    max_seq_len   tokens kept per input (default: sentence_bert_config.json, else 256)
    num_threads   intra-op threads, on CPU only (default: the backend's choice)
    backend       "torch" (default) or "onnx": the encoder's ONNX export run by ONNX Runtime.
                  Its inputs are `input_ids`, `attention_mask` and optionally `token_type_ids`;
                  its first output the last hidden states [batch, tokens, dims] (pooled here) or
                  the sentence embeddings [batch, dims]. `spin` and `optimization` as for the
                  `onnx` runner.
    file          the ONNX file (default: onnx/model.onnx, else model.onnx)

This is the only module that imports torch and transformers; only the worker imports it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch
import transformers

from sluice import wire
from sluice.engines.base import ItemFailure, PreparedItem, num_threads_of, stack_rows
from sluice.engines.device_gate import DEVICE_GATE
from sluice.errors import ConfigError, InvalidInput
from sluice.repository import ModelVersion

DEFAULT_MAX_SEQ_LEN = 256
WARMUP_SHAPES = ((1, 16), (4, 16), (16, 16), (4, 128))
"""(items, tokens per item) of the batches timed at warm-up; each runs `WARMUP_REPEATS` times."""
WARMUP_REPEATS = 3

# (alpha_s, beta_s per padded token, reference cost): rough figures for a 6-layer, 384-wide
# encoder, measured on a 2-core CPU (1 thread: ~8 ms + 0.2 ms/token; 2 threads: ~5 ms +
# 0.13 ms/token) and estimated for a data-centre GPU. Warm-up refines them.
_CPU_PRIOR = (0.006, 0.00015, 64.0)
_CUDA_PRIOR = (0.003, 0.000002, 256.0)


class EmbeddingRunner:
    def __init__(self, version: ModelVersion, device: str) -> None:
        self.device = _torch_device(device, version.name)
        weights_dir = version.weights_dir
        backend = version.params.get("backend", "torch")
        self._model: Any = None
        self._session: _OnnxEncoder | None = None
        if backend == "torch":
            self._apply_num_threads(version)
            model = _load_model(weights_dir, version.name).to(self.device).eval()
            self._model = model
            self.dims = int(model.config.hidden_size)
            max_positions = int(model.config.max_position_embeddings)
            self.vocab_size = int(model.config.vocab_size)
        elif backend == "onnx":
            self._session = _OnnxEncoder(version, device)
            config = _read_json(weights_dir / "config.json", version.name)
            dims = self._session.dims or config.get("hidden_size")
            if not isinstance(dims, int):
                raise ConfigError(f"{version.name}: the ONNX graph's output has no fixed width and config.json "
                                  "no hidden_size: the embeddings' dimension is unknown")
            self.dims = dims
            max_positions = int(config.get("max_position_embeddings", 512))
            self.vocab_size = int(config.get("vocab_size", 0))
        else:
            raise ConfigError(f"{version.name}: backend must be 'torch' or 'onnx', got {backend!r}")
        self.max_seq_len = _max_seq_len(version, weights_dir, max_positions)
        self._tokenizer, self._pad_id = _load_tokenizer(weights_dir, self.max_seq_len, version.name)
        _check_pooling(weights_dir, version.name)
        self.info = wire.ModelInfo(
            name=version.name,
            version=version.version,
            kind="embedding",
            platform=version.platform,
            inputs=(wire.TensorSpec("text", "BYTES", (-1,)),),
            outputs=(wire.TensorSpec("embedding", "FP32", (-1, self.dims)),),
            max_batch_size=version.batching.max_batch_size,
            max_batch_cost=version.batching.max_batch_cost,
            slo_s=version.slo_s,
            accepts_text=True,
            accepts_tensor=False,
            max_model_len=self.max_seq_len,  # what it keeps of an input: a bound on its tokens
            vocab_size=self.vocab_size,
            accepts_token_ids=self.vocab_size > 0,
            cache_revision=version.cache_revision,
        )

    def prior(self) -> tuple[float, float, float]:
        return _CUDA_PRIOR if self.device.type == "cuda" else _CPU_PRIOR

    def warmup(self) -> list[tuple[int, float]]:
        """Time a few batches of dummy text; the first, untimed run absorbs one-off start-up costs."""
        filler = self._tokenizer.encode("warm up " * self.max_seq_len).ids  # truncated to max_seq_len
        self.run_batch([_dummy_item(filler, 16)])
        observations: list[tuple[int, float]] = []
        for num_items, length in WARMUP_SHAPES:
            items = [_dummy_item(filler, length)] * num_items
            padded_cost = num_items * items[0].cost
            for _ in range(WARMUP_REPEATS):
                start = time.perf_counter()
                self.run_batch(items)
                observations.append((padded_cost, time.perf_counter() - start))
        return observations

    def prepare(self, payload: wire.Payload) -> list[PreparedItem]:
        if isinstance(payload, wire.TokensPayload):
            return [self._token_item(ids) for ids in payload.token_ids]
        if not isinstance(payload, wire.TextPayload):
            got = f"a tensor ({payload.dtype} {list(payload.shape)})" if isinstance(payload, wire.TensorPayload) \
                else "a generation request"
            raise InvalidInput(f"model {self.info.name!r} embeds text: send a list of strings, not {got}")
        encodings = self._tokenizer.encode_batch(payload.texts)
        return [
            PreparedItem(cost=len(e.ids), data=np.asarray(e.ids, dtype=np.int64), num_tokens=len(e.ids))
            for e in encodings
        ]

    def run_batch(self, items: Sequence[PreparedItem]) -> list[np.ndarray | ItemFailure]:
        if self._model is None and self._session is None:
            raise RuntimeError(f"runner for {self.info.name!r} is closed")
        if not items:
            return []
        ids, mask = self._pad(items)
        if self._session is not None:
            return [_row_or_failure(row) for row in self._session.embed(ids, mask)]
        with torch.inference_mode():
            input_ids = torch.from_numpy(ids).to(self.device)
            attention_mask = torch.from_numpy(mask).to(self.device)
            hidden = self._model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
            summed = (hidden * weights).sum(dim=1)
            pooled = summed / weights.sum(dim=1).clamp(min=1e-9)
            vectors = torch.nn.functional.normalize(pooled, p=2.0, dim=1).float().cpu().numpy()
        return [_row_or_failure(row) for row in vectors]

    def pack(self, outputs: Sequence[np.ndarray]) -> wire.Payload:
        if not outputs:
            empty = np.zeros((0, self.dims), dtype=np.float32)
            return wire.TensorPayload(dtype="float32", shape=empty.shape, data=empty.tobytes())
        return stack_rows(outputs)

    def close(self) -> None:
        """Release the weights; on CUDA, hand the cached memory back to the device."""
        self._model = None
        self._session = None
        if self.device.type == "cuda":
            with DEVICE_GATE.shared():  # never while another model records a CUDA graph
                torch.cuda.empty_cache()

    def _token_item(self, ids: list[int]) -> PreparedItem:
        """An input the client tokenized itself, run as it is (no special tokens added, none cut)."""
        if not 1 <= len(ids) <= self.max_seq_len:
            raise InvalidInput(f"an input of token ids must hold 1 to {self.max_seq_len} of them, got {len(ids)}")
        array = np.asarray(ids, dtype=np.int64)
        if self.vocab_size and (array.min() < 0 or array.max() >= self.vocab_size):
            raise InvalidInput(f"token ids must be in [0, {self.vocab_size}) for model {self.info.name!r}")
        return PreparedItem(cost=len(ids), data=array, num_tokens=len(ids))

    def _apply_num_threads(self, version: ModelVersion) -> None:
        num_threads = num_threads_of(version)
        if num_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(num_threads)

    def _pad(self, items: Sequence[PreparedItem]) -> tuple[np.ndarray, np.ndarray]:
        longest = max(len(item.data) for item in items)
        ids = np.full((len(items), longest), self._pad_id, dtype=np.int64)
        mask = np.zeros((len(items), longest), dtype=np.int64)
        for row, item in enumerate(items):
            ids[row, : len(item.data)] = item.data
            mask[row, : len(item.data)] = 1
        return ids, mask


class _OnnxEncoder:
    """The encoder's ONNX export on ONNX Runtime: token ids and mask in, unit vectors out."""

    def __init__(self, version: ModelVersion, device: str) -> None:
        from sluice.engines.onnx_runtime import onnx_session

        name = version.params.get("file")
        if name is None:
            name = "onnx/model.onnx" if (version.weights_dir / "onnx" / "model.onnx").is_file() else "model.onnx"
        self._session = onnx_session(version, version.weights_dir / str(name), device)
        inputs = {value.name: value for value in self._session.get_inputs()}
        known = ("input_ids", "attention_mask", "token_type_ids")
        unknown = [name for name in inputs if name not in known]
        if unknown or "input_ids" not in inputs:
            raise ConfigError(f"{version.name}: the ONNX encoder takes {', '.join(inputs)}; it must take input_ids "
                              f"and may take attention_mask and token_type_ids")
        self._int32 = {name for name, value in inputs.items() if value.type == "tensor(int32)"}
        self._inputs = list(inputs)
        output = self._session.get_outputs()[0]
        if len(output.shape) not in (2, 3):
            raise ConfigError(f"{version.name}: the ONNX encoder's first output {output.name!r} has shape "
                              f"{output.shape}: expected [batch, tokens, dims] or [batch, dims]")
        self._output = output.name
        last = output.shape[-1]
        self.dims = last if isinstance(last, int) and last > 0 else None

    def embed(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        given = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        feed = {name: given[name].astype(np.int32) if name in self._int32 else given[name] for name in self._inputs}
        (hidden,) = self._session.run([self._output], feed)
        hidden = np.asarray(hidden, dtype=np.float32)
        if hidden.ndim == 3:  # last hidden states: the mean over the mask, as sentence-transformers pools
            weights = mask[:, :, None].astype(np.float32)
            hidden = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
        norms = np.maximum(np.linalg.norm(hidden, axis=1, keepdims=True), 1e-12)
        return hidden / norms


def _torch_device(device: str, model_name: str) -> torch.device:
    try:
        parsed = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"{model_name}: bad device {device!r}: {exc}") from exc
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{model_name}: device {device!r} requested but CUDA is not available")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise ConfigError(f"{model_name}: no CUDA device {parsed.index} ({count} present)")
    elif parsed.type != "cpu":
        raise ConfigError(f"{model_name}: device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return parsed


def _load_model(weights_dir: Path, model_name: str) -> Any:
    transformers.logging.disable_progress_bar()  # no tqdm bars in logs
    try:
        return transformers.AutoModel.from_pretrained(str(weights_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{model_name}: cannot load the encoder from {weights_dir}: {exc}") from exc


def _max_seq_len(version: ModelVersion, weights_dir: Path, max_positions: int) -> int:
    raw = version.params.get("max_seq_len")
    if raw is None:
        raw = _read_json(weights_dir / "sentence_bert_config.json", version.name).get(
            "max_seq_length", DEFAULT_MAX_SEQ_LEN
        )
    if isinstance(raw, bool) or not isinstance(raw, int) or not 2 <= raw <= max_positions:
        raise ConfigError(f"{version.name}: max_seq_len must be an integer in [2, {max_positions}], got {raw!r}")
    return raw


def _load_tokenizer(weights_dir: Path, max_seq_len: int, model_name: str) -> tuple[tokenizers.Tokenizer, int]:
    """The fast tokenizer, truncating to `max_seq_len` and not padding (batches pad themselves)."""
    path = weights_dir / "tokenizer.json"
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for missing or malformed files
        raise ConfigError(f"{model_name}: cannot load {path}: {exc}") from exc
    padding = tokenizer.padding
    pad_id = padding["pad_id"] if padding else tokenizer.token_to_id("[PAD]")
    if pad_id is None:
        raise ConfigError(f"{model_name}: {path} defines no padding token")
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_seq_len)
    return tokenizer, int(pad_id)


def _check_pooling(weights_dir: Path, model_name: str) -> None:
    """Refuse a model trained with another pooling: its vectors would load fine and be wrong."""
    pooling = _read_json(weights_dir / "1_Pooling" / "config.json", model_name)
    if pooling and not pooling.get("pooling_mode_mean_tokens", False):
        raise ConfigError(f"{model_name}: 1_Pooling/config.json asks for a pooling other than mean")


def _read_json(path: Path, model_name: str) -> dict[str, Any]:
    """A JSON object from an optional file; {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{model_name}: cannot read {path}: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{model_name}: {path} is not a JSON object")
    return value


def _dummy_item(filler: list[int], length: int) -> PreparedItem:
    """`length` tokens of filler text, keeping its final special token ([SEP])."""
    length = min(length, len(filler))
    ids = np.asarray(filler[: length - 1] + filler[-1:], dtype=np.int64)
    return PreparedItem(cost=length, data=ids, num_tokens=length)


def _row_or_failure(row: np.ndarray) -> np.ndarray | ItemFailure:
    if not np.isfinite(row).all():
        return ItemFailure("the model produced non-finite values for this input")
    return row

"""The embedding runner on a CUDA device gives the CPU's vectors. The model is a tiny random-weight
BERT with a WordPiece tokenizer, written here (the real minilm's 90 MB do not travel to a GPU
machine). Skipped without a GPU (CI has none); run on one with `pytest -m gpu`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sluice import wire
from sluice.engines import ItemFailure, load_runner
from sluice.engines.embedding import EmbeddingRunner
from sluice.repository import MANIFEST, ModelVersion, scan_repository, write_manifest

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE = "cuda"
WORDS = ["a", "man", "is", "playing", "guitar", "the", "new", "movie", "awesome", "sluice", "batches", "inference",
         "requests", "that", "arrive", "one", "at", "time", "into", "groups", "share", "device", "x"]
TEXTS = ["A man is playing a guitar.", "The new movie is awesome!", "x", "",
         " ".join(["sluice batches inference requests"] * 40)]  # longer than max_seq_len: truncated


def write_tiny_bert(repo: Path) -> ModelVersion:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel

    version = repo / "tiny-bert" / "1"
    version.mkdir(parents=True)
    tokens = dict.fromkeys(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS, *"abcdefghijklmnopqrstuvwxyz.!"])
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    tokenizer.save(str(version / "tokenizer.json"))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128)
    BertModel(config).save_pretrained(str(version))
    (version / "1_Pooling").mkdir()
    (version / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    write_manifest(version, version / MANIFEST)
    (repo / "tiny-bert" / "model.toml").write_text(
        'kind = "embedding"\n[batching]\nmax_batch_size = 8\n[slo]\ndefault_ms = 1000\n[params]\nmax_seq_len = 32\n')
    return next(v for v in scan_repository(repo).versions if v.name == "tiny-bert")


def embed(runner: EmbeddingRunner, texts: list[str]) -> np.ndarray:
    outputs = runner.run_batch(runner.prepare(wire.TextPayload(texts)))
    assert not any(isinstance(out, ItemFailure) for out in outputs)
    payload = runner.pack(outputs)  # type: ignore[arg-type]
    assert isinstance(payload, wire.TensorPayload)
    return np.frombuffer(payload.data, dtype=payload.dtype).reshape(payload.shape)


def test_embeddings_on_cuda_match_the_cpu(tmp_path: Path) -> None:
    version = write_tiny_bert(tmp_path)
    cpu, gpu = load_runner(version, "cpu"), load_runner(version, DEVICE)
    assert isinstance(cpu, EmbeddingRunner) and isinstance(gpu, EmbeddingRunner)
    try:
        assert gpu.device.type == DEVICE and next(gpu._model.parameters()).device.type == DEVICE
        gpu.warmup()
        batched = embed(gpu, TEXTS)
        assert batched.shape == (len(TEXTS), 64)
        np.testing.assert_allclose(batched, embed(cpu, TEXTS), atol=1e-4)
        np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)
        alone = np.concatenate([embed(gpu, [text]) for text in TEXTS])  # padding in a batch changes nothing
        np.testing.assert_allclose(batched, alone, atol=1e-4)
    finally:
        cpu.close()
        gpu.close()

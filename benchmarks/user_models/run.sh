#!/usr/bin/env bash
# A user's own ONNX model through sluice: all-MiniLM-L6-v2 exported to ONNX (mean pooling and
# normalisation in the graph) and served by the `onnx` runner, one request = one sentence of 16
# token ids (input_ids and attention_mask, INT64 [1, 16]) through KServe v2. Goodput at p99 <=
# 500 ms with batching (max batch 32) against the same server with max batch 1.
#
# Usage: benchmarks/user_models/run.sh [batching] [nobatch]   (default: both)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT_DIR:-benchmarks/results}
mkdir -p "$out"
sluice=${SLUICE:-.venv/bin/sluice}
python=${PYTHON:-.venv/bin/python}
port=8766
source benchmarks/serve.sh

repo=$(mktemp -d)
trap 'rm -rf "$repo"' EXIT
"$python" benchmarks/user_models/export_minilm.py "$repo" --max-batch-size 32 --num-threads 1 2>/dev/null
bench() { "$sluice" bench --url "http://127.0.0.1:$port" --endpoint kserve --model minilm-onnx --input-len 16 \
                          --duration 15 --slo-ms 500 "$@"; }

step_batching() {
  sed -i 's/max_batch_size = .*/max_batch_size = 32/' "$repo/minilm-onnx/model.toml"
  serve "$repo" onnx-batching
  bench --rates 50,100,150,200,250,300 --out "$out/minilm-onnx-batching.json"
  stop
}
step_nobatch() {
  sed -i 's/max_batch_size = .*/max_batch_size = 1/' "$repo/minilm-onnx/model.toml"
  serve "$repo" onnx-nobatch
  bench --rates 25,50,75,100,125,150 --out "$out/minilm-onnx-nobatch.json"
  stop
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(batching nobatch)
for step in "${steps[@]}"; do "step_$step"; done

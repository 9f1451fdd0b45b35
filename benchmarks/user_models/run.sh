#!/usr/bin/env bash
# A user's own ONNX model through sluice: all-MiniLM-L6-v2 exported to ONNX (mean pooling and
# normalisation in the graph) and served by the `onnx` runner, one request = one sentence of 16
# token ids (input_ids and attention_mask, INT64 [1, 16]) through KServe v2. Goodput at p99 <=
# 500 ms with batching (max batch 32) against the same server with max batch 1; then sentences
# of 8 to 24 tokens, with rows of different lengths padded into one call ([params.pad]) or not.
#
# Usage: benchmarks/user_models/run.sh [batching] [nobatch] [padded] [unpadded]   (default: all)
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
bench() { "$sluice" bench --url "http://127.0.0.1:$port" --endpoint kserve --model minilm-onnx \
                          --duration 15 --slo-ms 500 "$@"; }
settings() {  # settings MAX_BATCH PAD(0/1)
  sed -i -e "s/max_batch_size = .*/max_batch_size = $1/" -e '/^\[params.pad\]/,$d' "$repo/minilm-onnx/model.toml"
  [ "$2" = 1 ] && printf '[params.pad]\ninput_ids = 0\nattention_mask = 0\n' >> "$repo/minilm-onnx/model.toml"
  return 0
}

step_batching() {
  settings 32 0; serve "$repo" onnx-batching
  bench --input-len 16 --rates 50,100,150,200,250,300 --out "$out/minilm-onnx-batching.json"
  stop
}
step_nobatch() {
  settings 1 0; serve "$repo" onnx-nobatch
  bench --input-len 16 --rates 25,50,75,100,125,150 --out "$out/minilm-onnx-nobatch.json"
  stop
}
step_padded() {
  settings 32 1; serve "$repo" onnx-padded
  bench --input-len 8:24 --rates 50,100,150,200,250,300 --out "$out/minilm-onnx-padded.json"
  stop
}
step_unpadded() {
  settings 32 0; serve "$repo" onnx-unpadded
  bench --input-len 8:24 --rates 50,100,150,200,250,300 --out "$out/minilm-onnx-unpadded.json"
  stop
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(batching nobatch padded unpadded)
for step in "${steps[@]}"; do "step_$step"; done

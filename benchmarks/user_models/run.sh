#!/usr/bin/env bash
# ONNX models through sluice, all-MiniLM-L6-v2 exported by export_minilm.py:
# - batching, nobatch, padded, unpadded: a user's own model, the `onnx` runner (mean pooling
#   and normalisation in the graph), one request = one sentence of token ids (input_ids and
#   attention_mask, INT64 [1, L]) through KServe v2. Goodput at p99 <= 500 ms with batching (max
#   batch 32) against max batch 1 (L = 16); then L from 8 to 24, rows of different lengths padded
#   into one call ([params.pad]) or not.
# - onnx-embeddings, torch-embeddings: the embedding runner through /v1/embeddings, one sentence
#   per request, on the model's ONNX export (`--layout hidden`, `backend = "onnx"`, THREADS
#   intra-op threads, default 2) and on PyTorch (the demo's minilm: torch's default, 2 threads
#   here); env RATES overrides their rates.
#
# Usage: benchmarks/user_models/run.sh [STEP...]   (default: all six, in the order above)
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
embeddings() { "$sluice" bench --url "http://127.0.0.1:$port" --endpoint embeddings --model minilm --duration 15 \
                               --slo-ms 500 --rates "${RATES:-100,150,200,250,300,350}" "$@"; }
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
step_onnx-embeddings() {
  "$python" benchmarks/user_models/export_minilm.py "$repo/embeddings" --layout hidden --name minilm \
      --num-threads "${THREADS:-2}" 2>/dev/null
  serve "$repo/embeddings" embeddings-onnx
  embeddings --out "$out/minilm-embeddings-onnx.json"
  stop
}
step_torch-embeddings() {
  serve src/sluice/demo_models embeddings-torch
  embeddings --out "$out/minilm-embeddings-torch.json"
  stop
}
step_unpadded() {
  settings 32 0; serve "$repo" onnx-unpadded
  bench --input-len 8:24 --rates 50,100,150,200,250,300 --out "$out/minilm-onnx-unpadded.json"
  stop
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(batching nobatch padded unpadded onnx-embeddings torch-embeddings)
for step in "${steps[@]}"; do "step_$step"; done

#!/usr/bin/env bash
# Everything sluice checks and measures on a CUDA machine, in one go (about 5 minutes on an H200):
#   1. the GPU tests (generative engine against transformers, embeddings against the CPU);
#   2. the engine's decode step at 8, 32 and 96 sequences (step_profile.py, 1 B Llama, bf16; CUDA graphs on,
#      the default: gpu_graphs_check.sh compares them with eager steps);
#   3. continuous vs static batching on the engine at 60 req/s (engine_bench.py --online);
#   4. the same through the whole server at $RATE req/s (gpu_serve_bench.sh).
# Results and logs go to OUT_DIR; the numbers and their method are in benchmarks/generative/README.md.
#
# Usage: benchmarks/generative/gpu_check.sh [OUT_DIR]   (env: PYTHON, default python3; RATE, default 60)
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-benchmarks/results}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="src:.:${PYTHONPATH:-}"

$py -m pytest -q -p no:cacheprovider -m gpu -W ignore::UserWarning -W ignore::FutureWarning \
    tests/engines/generative/test_cuda.py tests/engines/test_embedding_cuda.py 2>&1 | tail -5 | tee "$out/gpu-tests.log"
for seqs in 8 32 96; do
  $py benchmarks/generative/step_profile.py --device cuda --dtype bfloat16 --model 1b --seqs "$seqs" \
      --profile-steps 3 2>&1 | grep -E "^(one|decode|per step)" | tee -a "$out/gpu-step-sizes.txt"
done
$py benchmarks/generative/engine_bench.py --online 60 --duration 8 --cap-s 40 --device cuda --dtype bfloat16 \
    --model 1b --kv-tokens 16384 --json "$out/gpu-online-rate60.json" 2>&1 | tail -5
RATE=${RATE:-60} PYTHON=$py benchmarks/generative/gpu_serve_bench.sh "$out" 2>&1 | grep -v "━" | tail -30

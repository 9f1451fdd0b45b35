#!/usr/bin/env bash
# Everything sluice checks and measures on a CUDA machine, in one go (about 6 minutes on an H200):
#   1. the GPU tests (generative engine against transformers, with and without CUDA graphs;
#      embeddings against the CPU) and the padded decode path's CPU tests;
#   2. the engine's decode step at 32 sequences without CUDA graphs, then at 8, 32 and 96 with
#      them, the default (step_profile.py, 1 B Llama, bf16);
#   3. continuous vs static batching on the engine at 60 req/s (engine_bench.py --online);
#   4. the continuous engine at 120 req/s (beyond what it keeps up with eagerly), without and with graphs;
#   5. continuous vs static through the whole server at $RATE req/s (gpu_serve_bench.sh).
# Results and logs go to OUT_DIR; the numbers and their method are in benchmarks/generative/README.md.
#
# Usage: benchmarks/generative/gpu_check.sh [OUT_DIR]   (env: PYTHON, default python3; RATE, default 60)
set -uo pipefail
# The test files are named folder by folder: pytest 9.1 (the H200 image's) does not give a file the
# fixtures of its folder's conftest.py when another folder's file comes between them on the command line.
cd "$(dirname "$0")/../.."
out=${1:-benchmarks/results}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="src:.:${PYTHONPATH:-}"

$py -m pytest -q -p no:cacheprovider -m "gpu or not gpu" -W ignore::UserWarning -W ignore::FutureWarning \
    tests/engines/generative/test_cuda.py tests/engines/generative/test_graphs.py \
    tests/engines/test_embedding_cuda.py tests/engines/test_user_models_cuda.py \
    2>&1 | tail -15 | tee "$out/gpu-tests.log"
step() {
  $py benchmarks/generative/step_profile.py --device cuda --dtype bfloat16 --model 1b --seqs "$1" --profile-steps 3 "${@:2}" \
      2>&1 | grep -E "^(one|decode|per step)" | sed "s/^/[$*] /" | tee -a "$out/gpu-step-sizes.txt"
}
step 32 --no-cuda-graphs
for seqs in 8 32 96; do step "$seqs"; done
$py benchmarks/generative/engine_bench.py --online 60 --duration 8 --cap-s 40 --device cuda --dtype bfloat16 \
    --model 1b --kv-tokens 16384 --json "$out/gpu-online-rate60.json" 2>&1 | tail -5
for graphs in --no-cuda-graphs ""; do
  $py benchmarks/generative/engine_bench.py --online 120 --duration 8 --cap-s 40 --device cuda --dtype bfloat16 \
      --model 1b --kv-tokens 16384 --modes continuous $graphs --json "$out/gpu-online120${graphs:+-eager}.json" 2>&1 | tail -2
done
RATE=${RATE:-60} PYTHON=$py benchmarks/generative/gpu_serve_bench.sh "$out" 2>&1 | grep -v "━" | tail -30
grep -E "Traceback|Error|terminate" "$out/gpu-server.log" | cut -c1-300 | head -5

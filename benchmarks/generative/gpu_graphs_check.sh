#!/usr/bin/env bash
# CUDA graphs of decode steps on a CUDA machine, in one go (about 4 minutes on an H200):
#   1. the GPU tests (replayed graphs against transformers among them) and the padded path's CPU tests;
#   2. the decode step at 32 sequences without graphs, then at 8, 32 and 96 with them (step_profile.py);
#   3. the continuous engine at 120 req/s (beyond what it kept up with eagerly), without and with graphs;
#   4. the whole server at $RATE req/s with graphs (gpu_serve_bench.sh).
# Usage: benchmarks/generative/gpu_graphs_check.sh [OUT_DIR]   (env: PYTHON, default python3; RATE, default 60)
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-benchmarks/results}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="src:.:${PYTHONPATH:-}"

$py -m pytest -q -p no:cacheprovider -m "gpu or not gpu" -W ignore::UserWarning -W ignore::FutureWarning \
    tests/engines/generative/test_cuda.py tests/engines/generative/test_graphs.py 2>&1 | tail -15 | tee "$out/gpu-tests.log"
step() {
  $py benchmarks/generative/step_profile.py --device cuda --dtype bfloat16 --model 1b --seqs "$1" --profile-steps 3 "${@:2}" \
      2>&1 | grep -E "^(decode|per step)" | sed "s/^/[$*] /" | tee -a "$out/gpu-steps.txt"
}
step 32 --no-cuda-graphs
for seqs in 8 32 96; do step "$seqs"; done
for graphs in --no-cuda-graphs ""; do
  $py benchmarks/generative/engine_bench.py --online 120 --duration 8 --cap-s 40 --device cuda --dtype bfloat16 \
      --model 1b --kv-tokens 16384 --modes continuous $graphs --json "$out/gpu-online120${graphs:+-eager}.json" 2>&1 | tail -2
done
RATE=${RATE:-60} PYTHON=$py benchmarks/generative/gpu_serve_bench.sh "$out" 2>&1 | grep -v "━" | tail -30
rm -f "$out/gpu-serve-gpu-static.png"
grep -E "captured|Traceback|Error" "$out/gpu-server.log" | head -5

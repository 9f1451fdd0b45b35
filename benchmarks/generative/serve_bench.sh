#!/usr/bin/env bash
# Continuous vs static (request-level) batching of tiny-lm, measured through the server with
# `sluice bench` at the same offered online load (Poisson arrivals), same model, same KV budget.
# Results: benchmarks/results/generative-<mode>.json (+ .png); method and numbers in
# benchmarks/generative/README.md.
#
# Usage: benchmarks/generative/serve_bench.sh [mode...]   modes: continuous static static-maxtokens
# Env:   RATE (req/s, default 16), DURATION (s of arrivals, default 15), SLUICE (the sluice command)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/results
mkdir -p "$out"
sluice=${SLUICE:-.venv/bin/sluice}
port=${PORT:-8766}
rate=${RATE:-16}
duration=${DURATION:-15}

source benchmarks/serve.sh  # serve MODELS_DIR [LOG_NAME] / stop

run_mode() {
  serve "benchmarks/models/$1" server-generative
  echo "== $1: load average $(cut -d' ' -f1-3 /proc/loadavg)"
  $sluice bench --url "http://127.0.0.1:$port" --endpoint completions --model tiny-lm \
      --rate "$rate" --duration "$duration" --prompt-len 32:256 --output-len 16:128 --seed 0 \
      --ttft-slo-ms 2000 --tpot-slo-ms 100 --request-timeout-s 900 --out "$out/generative-$1.json"
  echo "== $1 done: load average $(cut -d' ' -f1-3 /proc/loadavg)"
  stop
}

modes=("$@")
[ ${#modes[@]} -eq 0 ] && modes=(continuous static)
for mode in "${modes[@]}"; do run_mode "$mode"; done

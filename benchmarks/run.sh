#!/usr/bin/env bash
# Reproduces every number in benchmarks/README.md on this machine (2 cores, no GPU).
# Each step starts its own server, runs `sluice bench` against it, and stops it.
# Usage: benchmarks/run.sh [step...]   steps: selftest emulated lowload overload minilm scenarios canary (default: all)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT_DIR:-benchmarks/results}
mkdir -p "$out"
sluice=.venv/bin/sluice
port=8765

source benchmarks/serve.sh  # serve MODELS_DIR / stop
bench() { "$sluice" bench --url "http://127.0.0.1:$port" "$@"; }

emulated_repo=$(mktemp -d)
cp -r src/sluice/demo_models/emulated "$emulated_repo/"

step_selftest() {
  "$sluice" bench --self-test --rate 2700 --duration 10 --out "$out/selftest.json"
}
step_emulated() {   # goodput at p99 <= 100 ms through KServe v2 infer, inputs of 16 values
  serve "$emulated_repo"
  bench --endpoint kserve --model emulated --input-len 16 --rates 400,600,800,1000,1100,1150,1200,1250,1300 \
        --duration 20 --slo-ms 100 --out "$out/emulated-sweep.json"
  stop
}
step_lowload() {    # median latency at 10 req/s against the device time of one item (8.5 ms)
  serve "$emulated_repo"
  bench --endpoint kserve --model emulated --input-len 16 --rate 10 --duration 30 --out "$out/emulated-lowload.json"
  stop
}
step_overload() {   # offered 2x capacity (2,666 req/s) for 30 s
  serve "$emulated_repo"
  bench --endpoint kserve --model emulated --input-len 16 --rate 2666 --duration 30 --max-connections 2000 \
        --out "$out/emulated-overload.json"
  stop
}
step_minilm() {
  step_minilm_batching
  step_minilm_nobatch
}
step_minilm_batching() {     # the real model on CPU: batching against max batch 1, goodput at p99 <= 500 ms
  serve src/sluice/demo_models
  bench --endpoint embeddings --model minilm --rates 100,150,200,250,300,350,400,450,500 --duration 15 --slo-ms 500 \
        --out "$out/minilm-batching.json"
  stop
}
step_minilm_nobatch() {
  serve benchmarks/models/nobatch
  bench --endpoint embeddings --model minilm --rates 20,40,60,80,100,120,140,160 --duration 15 --slo-ms 500 \
        --out "$out/minilm-nobatch.json"
  stop
}

step_scenarios() {  # issue 3: each scenario starts its own server (emulated device x3, tenants file, keys)
  for scenario in overload noisy-neighbour priority-mix weights; do
    "$sluice" bench --scenario "$scenario" --duration 20 --warmup 3 --out "$out/scenario-$scenario.json"
  done
}

step_canary() {     # canaries of a broken, flaky, slow and healthy version 2 under 400 req/s
  .venv/bin/python benchmarks/canary.py --out "$out/canary.json"
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(selftest emulated lowload overload minilm scenarios canary)
for step in "${steps[@]}"; do "step_$step"; done

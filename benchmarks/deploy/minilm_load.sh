#!/bin/bash
# benchmarks/deploy/minilm_load.sh load|noload
#
# The demo minilm under 40 req/s of /v1/embeddings for 20 s (sluice bench, 2 s warm-up). With
# "load", a second version is copied into the repository 7 s in and loaded while the requests
# flow (`sluice models load`). Prints the run's statuses and latency (and how long the load took).
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:?load or noload}
work=${WORK:-/tmp/sluice-deploy}
port=${PORT:-8771}
rm -rf "$work"; mkdir -p "$work/repo"; cp -r src/sluice/demo_models/minilm "$work/repo/"

.venv/bin/sluice serve --models "$work/repo" --port "$port" > "$work/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 200); do curl -sf "localhost:$port/v2/health/ready" > /dev/null && break; sleep 0.3; done

.venv/bin/sluice bench --url "http://127.0.0.1:$port" --endpoint embeddings --model minilm --rate 40 \
    --duration 20 --warmup 2 --out "$work/$mode.json" > "$work/bench.log" 2>&1 &
bench=$!
if [ "$mode" = load ]; then
  sleep 7
  cp -r "$work/repo/minilm/1" "$work/repo/minilm/2"
  started=$(date +%s%N)
  .venv/bin/sluice models load minilm --url "http://127.0.0.1:$port"
  echo "the load took $(( ($(date +%s%N) - started) / 1000000 )) ms"
fi
wait $bench
python3 -c "
import json; r = json.load(open('$work/$mode.json'))['results'][0]; lat = r['latency']
print('$mode', r['status_counts'], 'p50 %.1f p99 %.1f max %.1f ms' % (lat['p50_ms'], lat['p99_ms'], lat['max_ms']))"

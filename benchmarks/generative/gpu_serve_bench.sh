#!/usr/bin/env bash
# Continuous vs static (request-level) batching through the whole server on a CUDA device: one
# `sluice serve --device cuda` with two models of the same ~1 B random-weight Llama (bf16,
# `engine_bench.py --model 1b`) and the same 512 MiB of KV (16,384 tokens), one scheduling
# continuously, one statically (each member reserving max_model_len = 1,024 tokens), measured in
# turn by `sluice bench --endpoint completions` at the same Poisson load.
#
# Usage: benchmarks/generative/gpu_serve_bench.sh [OUT_DIR]   (default benchmarks/results)
# Env:   RATE (req/s, default 30), DURATION (s, default 6), PYTHON (default python3), PORT,
#        DEVICE (default cuda), MODEL (default 1b; "tiny" to try the script on a CPU),
#        CUDA_GRAPHS (1, the default: decode steps replay CUDA graphs; 0: every step eager)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-benchmarks/results}
py=${PYTHON:-python3}
rate=${RATE:-30}
duration=${DURATION:-6}
port=${PORT:-8799}
device=${DEVICE:-cuda}
export BENCH_MODEL=${MODEL:-1b} CUDA_GRAPHS=${CUDA_GRAPHS:-1}
mkdir -p "$out"
repo=$(mktemp -d)
trap 'rm -rf "$repo"' EXIT

PYTHONPATH="benchmarks/generative:${PYTHONPATH:-}" $py - "$repo" <<'EOF'
import os
import shutil
import sys
from pathlib import Path

from engine_bench import MODELS

from sluice.engines.generative.tiny import make_tiny_lm
from sluice.repository import MANIFEST, write_manifest

repo = Path(sys.argv[1])
weights = make_tiny_lm(repo / "gpu-continuous" / "1", **MODELS[os.environ["BENCH_MODEL"]])
write_manifest(weights, weights / MANIFEST)
shutil.copytree(weights, repo / "gpu-static" / "1", copy_function=os.link)
params = ('kind = "generative"\n[slo]\ndefault_ms = 600000\n[params]\ndtype = "bfloat16"\nkv_cache_mb = 512\n'
          "max_model_len = 1024\nmax_num_seqs = 256\nmax_num_batched_tokens = 2048\n"
          f"cuda_graphs = {'true' if os.environ['CUDA_GRAPHS'] == '1' else 'false'}\n")
(repo / "gpu-continuous" / "model.toml").write_text(params)
(repo / "gpu-static" / "model.toml").write_text(params + 'scheduling = "static"\nstatic_reserve = "max_model_len"\n')
EOF

# info: the log says whether each model recorded its CUDA graphs (checked at the end)
$py -m sluice serve --port "$port" --models "$repo" --device "$device" --log-level info > "$out/gpu-server.log" 2>&1 &
server=$!
$py - "$port" <<'EOF'
import sys
import time
import urllib.request

for _ in range(600):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/v2/health/ready", timeout=1) as answer:
            if answer.status == 200:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(0.2)
sys.exit("the server did not become ready")
EOF
for model in gpu-continuous gpu-static; do
  $py -m sluice bench --url "http://127.0.0.1:$port" --endpoint completions --model "$model" --rate "$rate" \
      --duration "$duration" --warmup 1 --prompt-len 32:256 --output-len 16:128 --seed 0 --ttft-slo-ms 2000 \
      --tpot-slo-ms 100 --request-timeout-s 120 --out "$out/gpu-serve-$model.json"
done
kill -TERM "$server"
wait "$server" || true
if [ "$device" != cpu ] && [ "$CUDA_GRAPHS" = 1 ]; then
  recorded=$(grep -c "captured [0-9]* CUDA graphs" "$out/gpu-server.log" || true)
  echo "models that recorded their CUDA graphs: $recorded of 2"
  grep -q "could not capture CUDA graphs" "$out/gpu-server.log" && echo "WARNING: a model ran its decode steps eagerly (see $out/gpu-server.log)"
fi
true

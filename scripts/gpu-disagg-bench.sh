#!/usr/bin/env bash
# Disaggregated serving on one GPU machine: prefill and decode workers as two processes on the same
# GPU, KV over CUDA IPC, behind a router — against the colocated server on the same GPU.
#   1. bench/disagg_check.py on the demo model and on a Qwen3-30B-A3B-shaped model cut to LAYERS
#      layers: identical greedy text, and every hand-off's bytes, copies, ms and GB/s;
#   2. bench/serve_bench.py (TTFT, TPOT, ITL) against the colocated server and the router, same
#      model, same load.
#
#   scripts/gpu-check.sh --pack DIR [BUILD]             (here: build for sm_90a and pack)
#   scripts/gpu-disagg-bench.sh --prebuilt DIR [--layers N] [--results FILE] [--concurrency LIST] [--shapes LIST]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
prebuilt="" layers=4 results="bench/results/$(date -u +%Y-%m-%d)-h200-disagg.jsonl"
concurrency="1,16" shapes="2048x128"
while [ $# -gt 0 ]; do
  case "$1" in
    --prebuilt) prebuilt="$2"; shift 2 ;;
    --layers) layers="$2"; shift 2 ;;
    --results) results="$2"; shift 2 ;;
    --concurrency) concurrency="$2"; shift 2 ;;
    --shapes) shapes="$2"; shift 2 ;;
    *) echo "gpu-disagg-bench: unknown argument $1" >&2; exit 2 ;;
  esac
done
source scripts/gpu-prebuilt.sh
use_prebuilt "$prebuilt"
mkdir -p "$(dirname "$results")"
device="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
bash scripts/unpack-models.sh >/dev/null

echo "== ceilings (copy bandwidth, GEMM) of this run"
"$bin/relay" bench --mode ceilings --quick --out "$results"
echo "== disagg_check: demo model"
python3 bench/disagg_check.py --relay "$bin/relay" --device cuda --num-kv-blocks 8192 --long-prompt 3000 \
  --out "$results"
mdir="/tmp/relay-bench-30b-a3b-${layers}l"
[ -f "$mdir/config.json" ] || "$bin/relay" make-model --preset 30b-a3b --layers "$layers" --out "$mdir" | tail -1
echo "== disagg_check: 30b-a3b shapes, $layers layers"
python3 bench/disagg_check.py --relay "$bin/relay" --device cuda --model "$mdir" --num-kv-blocks 16384 \
  --long-prompt 4000 --out "$results"

# Serving: the colocated server, then router + prefill + decode (each with half the KV pages).
serve_opts=(--device cuda --model "$mdir" --served-model-name bench --max-num-seqs 128 --max-model-len 8192)
wait_health() {  # $1 = port, $2 = path (default /health)
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$1${2:-/health}" >/dev/null && return 0
    sleep 0.5
  done
  echo "server on port $1 did not come up" >&2
  return 1
}
load() {  # $1 = label, $2 = port
  PYTHONUNBUFFERED=1 python3 bench/serve_bench.py --base "http://127.0.0.1:$2" --model bench --shapes "$shapes" \
    --concurrency "$concurrency" --device "$device $1" --out "$results"
}
echo "== serving, colocated"
"$bin/relay" serve "${serve_opts[@]}" --num-kv-blocks 32768 --port 8100 > /tmp/colocated.log 2>&1 &
pid=$!
wait_health 8100 && load colocated 8100
kill -TERM $pid; wait $pid || true
echo "== serving, disaggregated (prefill + decode on one GPU, CUDA IPC)"
"$bin/relay" serve --role router --model "$mdir" --served-model-name bench --port 8200 > /tmp/router.log 2>&1 &
pids=($!)
wait_health 8200 /version  # the router's /health is 503 until its workers are up
for role in prefill decode; do
  port=$([ $role = prefill ] && echo 8201 || echo 8202)
  "$bin/relay" serve "${serve_opts[@]}" --num-kv-blocks 16384 --role $role --router 127.0.0.1:8200 --port $port \
    > /tmp/$role.log 2>&1 &
  pids+=($!)
done
wait_health 8201 && wait_health 8202
wait_health 8200  # both workers registered
load disaggregated 8200
grep -c "KV hand-off" /tmp/prefill.log || true
grep "KV hand-off" /tmp/prefill.log | tail -3 || true
kill -TERM "${pids[@]}"; wait || true
cp "$results" /tmp/*.log "${OUT:-/tmp}/" 2>/dev/null || true

#!/usr/bin/env bash
# Serving benchmark on the GPU machine: `relay serve --device cuda` on the 12-layer benchmark model,
# driven by bench/serve_bench.py (TTFT, TPOT, ITL p50/p99, output tok/s) at concurrency 1, 16, 64 and
# 256 with 1k-in/1k-out and 4k-in/256-out requests.
#
#   scripts/gpu-check.sh --pack DIR                      (here: build for sm_90a and pack)
#   scripts/gpu-serve-bench.sh --prebuilt DIR [--results FILE] [--concurrency LIST] [--shapes LIST]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
prebuilt="" results="bench/results/$(date -u +%Y-%m-%d)-h200-serve.jsonl"
concurrency="1,16,64,256" shapes="1024x1024,4096x256"
while [ $# -gt 0 ]; do
  case "$1" in
    --prebuilt) prebuilt="$2"; shift 2 ;;
    --results) results="$2"; shift 2 ;;
    --concurrency) concurrency="$2"; shift 2 ;;
    --shapes) shapes="$2"; shift 2 ;;
    *) echo "gpu-serve-bench: unknown argument $1" >&2; exit 2 ;;
  esac
done
source scripts/gpu-prebuilt.sh
use_prebuilt "$prebuilt"
logs="${OUT:-$root/build-gpu-logs}"
mkdir -p "$logs" "$(dirname "$results")"

bash scripts/unpack-models.sh  # make-model copies the demo model's tokenizer
mdir=/tmp/relay-bench-30b-a3b-12l
if [ ! -f "$mdir/config.json" ]; then
  "$bin/relay" make-model --preset 30b-a3b --layers 12 --out "$mdir" 2>&1 | tail -2
fi
# relay bench at the batches and mean decode contexts of the serving levels (1k-in/1k-out: ~1536,
# 4k-in/256-out: ~4224), in the same run, so the server's decode rate has its own reference.
contexts=""
for shape in ${shapes//,/ }; do
  contexts="${contexts:+$contexts,}$(( ${shape%x*} + ${shape#*x} / 2 ))"
done
"$bin/relay" bench --mode model --model "$mdir" --prefill-lengths 512 --decode-batches "$concurrency" \
  --decode-contexts "$contexts" --out "$results" > "$logs/serve-ref-bench.log" 2>&1 || {
  tail -5 "$logs/serve-ref-bench.log"; exit 1; }
grep '"mode": *"decode"\|"mode":"decode"' "$results" | tail -n 20 || true
port=8000
"$bin/relay" serve --device cuda --model "$mdir" --served-model-name bench --port "$port" \
  --max-num-seqs 256 --max-num-batched-tokens 8192 --max-model-len 8192 > "$logs/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  kill -0 $server 2>/dev/null || { tail -20 "$logs/serve.log"; exit 1; }
  sleep 0.5
done
grep -m3 -i -E "load|kv" "$logs/serve.log" || true
PYTHONUNBUFFERED=1 python3 bench/serve_bench.py --base "http://127.0.0.1:$port" --model bench \
  --shapes "$shapes" --concurrency "$concurrency" --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
  --out "$results"
curl -s "http://127.0.0.1:$port/metrics" | grep -E "^relay:(num_preemptions_total|generation_tokens_total|request_success_total|engine_step_phase_seconds_total|engine_step_seconds_total|output_deliver)" || true
kill -TERM $server; wait $server || true
tail -3 "$logs/serve.log"
cp "$results" "$logs/" 2>/dev/null || true

#!/usr/bin/env bash
# Issue 8's runs on a machine with several GPUs, in one command (a session's device time is short):
#   1. correctness: each layout that fits the GPUs (TP 2, TP 2 + EP 2, DP 2 + EP 2; with 4 GPUs
#      TP 4 + EP 4, DP 4 + EP 4; with 8, TP 8 + EP 8, DP 8 + EP 8) against one GPU on the 12-layer
#      benchmark model: every position's logits and a greedy continuation (bench/sharded_compare.py);
#   2. collectives: Relay's one-shot / two-shot all-reduce against NCCL and the DP + EP dispatch /
#      combine, one rank per GPU (relay bench --mode collectives --ranks N);
#   3. disaggregation across GPUs: prefill and decode workers on different GPUs, each sharded its own
#      way, against the colocated server (bench/disagg_check.py: identical text, hand-off GB/s);
#   4. throughput per GPU of every layout on the 12-layer model (relay bench --mode model), then
#      Qwen3-235B-A22B's shapes with random weights (94 layers, --load-format dummy, FP8): DP N + EP N
#      decode and TP N + EP N prefill, N = 4 or 8.
#
#   scripts/gpu-check.sh --pack DIR [BUILD]             (here: build for sm_90a and pack)
#   scripts/gpu-multi-check.sh --prebuilt DIR [--runs 1,2,3,4] [--results FILE]
#
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and the PyTorch / NVSHMEM equivalents): on shared
# hosts it can take every GPU of the host out of service. Each run records its JSON lines in FILE
# (default bench/results/<date>-h200-x<N>.jsonl) and its log under $OUT.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
prebuilt="" runs="1,2,3,4" results=""
while [ $# -gt 0 ]; do
  case "$1" in
    --prebuilt) prebuilt="$2"; shift 2 ;;
    --runs) runs="$2"; shift 2 ;;
    --results) results="$2"; shift 2 ;;
    *) echo "gpu-multi-check: unknown argument $1" >&2; exit 2 ;;
  esac
done
source scripts/gpu-prebuilt.sh
use_prebuilt "$prebuilt"
export CUDA_MODULE_LOADING=EAGER
gpus="$(nvidia-smi -L | wc -l)"
[ "$gpus" -ge 2 ] || { echo "gpu-multi-check: needs 2 or more GPUs, found $gpus" >&2; exit 2; }
results="${results:-bench/results/$(date -u +%Y-%m-%d)-h200-x$gpus.jsonl}"
logs="${OUT:-$root/build-gpu-logs}"
mkdir -p "$(dirname "$results")" "$logs"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
nvidia-smi topo -m || true
bash scripts/unpack-models.sh >/dev/null
want() { [[ ",$runs," == *",$1,"* ]]; }
list() { seq -s, 0 $(($1 - 1)); }  # list 4 -> 0,1,2,3

# The layouts that fit: name=flags.
layouts=("tp2=--tp 2 --gpus 0,1" "tp2ep2=--tp 2 --ep 2 --gpus 0,1" "dp2ep2=--dp 2 --ep 2 --gpus 0,1")
for n in 4 8; do
  [ "$gpus" -ge "$n" ] && layouts+=("tp${n}ep${n}=--tp $n --ep $n --gpus $(list $n)"
                                      "dp${n}ep${n}=--dp $n --ep $n --gpus $(list $n)")
done

mdir=/tmp/relay-bench-30b-a3b-12l
if want 1 || want 3 || want 4; then
  [ -f "$mdir/config.json" ] || "$bin/relay" make-model --preset 30b-a3b --layers 12 --out "$mdir" | tail -1
fi
status=0
echo "== ceilings of this run (device 0)"
"$bin/relay" bench --mode ceilings --quick --out "$results"

if want 1; then
  echo "== run 1: sharded layouts against one GPU"
  args=()
  for l in "${layouts[@]}"; do args+=(--layout "$l"); done
  python3 bench/sharded_compare.py --model "$mdir" --relay "$bin/relay" "${args[@]}" --out "$results" 2>&1 |
    tee "$logs/run1-sharded-compare.log" || status=1
fi

if want 2; then
  echo "== run 2: collectives, one rank per GPU (2 .. $gpus ranks)"
  for n in 2 4 8; do
    [ "$gpus" -ge "$n" ] || continue
    CUDA_VISIBLE_DEVICES="$(list $n)" "$bin/relay" bench --mode collectives --ranks "$n" --out "$results" 2>&1 |
      tee "$logs/run2-collectives-$n.log" || status=1
  done
fi

if want 3; then
  echo "== run 3: disaggregation across GPUs"
  half=$((gpus / 2))
  if [ "$half" -ge 2 ]; then
    prefill="--tp 2 --gpus 0,1" decode="--dp 2 --ep 2 --gpus $half,$((half + 1))"
  else
    prefill="--gpu 0" decode="--gpu 1"
  fi
  python3 bench/disagg_check.py --relay "$bin/relay" --device cuda --model "$mdir" --num-kv-blocks 16384 \
    --long-prompt 4000 --prefill-args "$prefill" --decode-args "$decode" --out "$results" 2>&1 |
    tee "$logs/run3-disagg.log" || status=1
fi

if want 4; then
  echo "== run 4a: throughput per GPU of every layout (12-layer model)"
  for l in "${layouts[@]}"; do
    read -r -a flags <<< "${l#*=}"
    "$bin/relay" bench --mode model --model "$mdir" "${flags[@]}" --prefill-lengths 4096 \
      --decode-batches 1,64,256 --decode-contexts 1024 --max-num-batched-tokens 4096 --out "$results" 2>&1 |
      tee -a "$logs/run4-layouts.log" || status=1
  done
  if [ "$gpus" -ge 4 ]; then
    n=$([ "$gpus" -ge 8 ] && echo 8 || echo 4)
    big=/tmp/relay-235b-a22b-config
    [ -f "$big/config.json" ] || "$bin/relay" make-model --preset 235b-a22b --config-only --out "$big" | tail -1
    echo "== run 4b: Qwen3-235B-A22B shapes, random FP8 weights, DP $n + EP $n decode (1k in, 1k out)"
    "$bin/relay" bench --mode model --model "$big" --load-format dummy --dtype fp8 --dp "$n" --ep "$n" \
      --gpus "$(list $n)" --prefill-lengths 1024 --decode-batches 64,256 --decode-contexts 1536 \
      --max-num-batched-tokens 4096 --out "$results" 2>&1 | tee "$logs/run4-235b-decode.log" || status=1
    echo "== run 4c: Qwen3-235B-A22B shapes, TP $n + EP $n prefill"
    "$bin/relay" bench --mode model --model "$big" --load-format dummy --dtype fp8 --tp "$n" --ep "$n" \
      --gpus "$(list $n)" --prefill-lengths 4096,16384 --decode-batches 1 --decode-contexts 1024 \
      --out "$results" 2>&1 | tee "$logs/run4-235b-prefill.log" || status=1
  fi
fi
cp "$results" "$logs/" 2>/dev/null || true
echo "== done (status $status); results in $results"
exit "$status"

#!/usr/bin/env bash
# On the GPU machine: the GPU tests of the packed build, then the sharded DP+EP/TP layouts on the
# 12-layer 30B-A3B shape with dummy weights (greedy tokens per layout, which must agree).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"; cd "$root"
t0=$(date +%s)
bash scripts/gpu-check.sh --prebuilt .gpupack/bin --tests-only 2>&1 | tail -60
echo "== tests done in $(( $(date +%s) - t0 )) s"
source scripts/gpu-prebuilt.sh; use_prebuilt .gpupack/bin
"$bin/relay" make-model --preset 30b-a3b --layers 12 --config-only --out /tmp/cfg12 | tail -1
run() {
  local name="$1"; shift
  echo "== $name"
  timeout 120 "$bin/relay" bench --mode model --model /tmp/cfg12 --load-format dummy "$@" \
    --prefill-lengths 512 --decode-batches 1,8 --decode-contexts 512 --out "$OUT/sharded.jsonl" \
    > "$OUT/bench-$name.log" 2>&1
  echo "rc $?"; tail -4 "$OUT/bench-$name.log"
}
run single --max-num-batched-tokens 2048
run dp2ep2 --dp 2 --ep 2 --gpus 0,0 --max-num-batched-tokens 2048
run tp2ep2 --tp 2 --ep 2 --gpus 0,0 --max-num-batched-tokens 2048
run dp2ep2-default --dp 2 --ep 2 --gpus 0,0
run dp4ep4 --dp 4 --ep 4 --gpus 0,0,0,0 --max-num-batched-tokens 2048
python3 - "$OUT/sharded.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    j = json.loads(l)
    print({k: j.get(k) for k in ("layout", "tp", "dp", "ep", "phase", "batch", "tokens", "greedy_token", "greedy_tokens", "tok_per_s")})
PY
echo "== all done in $(( $(date +%s) - t0 )) s"

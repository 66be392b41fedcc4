#!/usr/bin/env bash
# phase tests: GPU tests; phase bench: sharded layouts on the 12-layer 30B-A3B shape (dummy weights).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"; cd "$root"
rm -rf .gpupack/bin; tar -C .gpupack -xJf .gpupack/c/bin.tar.xz
t0=$(date +%s)
if [ "$1" = tests ]; then
  timeout 500 bash scripts/gpu-check.sh --prebuilt .gpupack/bin --tests-only > "$OUT/tests.log" 2>&1
  echo "tests rc $? in $(( $(date +%s) - t0 )) s"; grep -E "FAILED|PASSED|tests from|Unwarmed" "$OUT/tests.log" | tail -15
  [ "$#" -gt 1 ] || exit 0; shift
fi
source scripts/gpu-prebuilt.sh; use_prebuilt .gpupack/bin
"$bin/relay" make-model --preset 30b-a3b --layers 12 --config-only --out /tmp/cfg12 | tail -1
run() {
  local name="$1"; shift
  echo "== $name"
  timeout 100 "$bin/relay" bench --mode model --model /tmp/cfg12 --load-format dummy "$@" \
    --prefill-lengths 512 --decode-batches 1,8 --decode-contexts 512 --out "$OUT/sharded.jsonl" \
    > "$OUT/bench-$name.log" 2>&1
  echo "rc $? at $(( $(date +%s) - t0 )) s"; tail -3 "$OUT/bench-$name.log"
}
for l in "$@"; do
  case $l in
    single) run single --max-num-batched-tokens 2048 ;;
    dp2ep2) run dp2ep2 --dp 2 --ep 2 --gpus 0,0 --max-num-batched-tokens 2048 ;;
    tp2ep2) run tp2ep2 --tp 2 --ep 2 --gpus 0,0 --max-num-batched-tokens 2048 ;;
    dp2ep2-default) run dp2ep2-default --dp 2 --ep 2 --gpus 0,0 ;;
    dp4ep4) run dp4ep4 --dp 4 --ep 4 --gpus 0,0,0,0 --max-num-batched-tokens 2048 ;;
  esac
done

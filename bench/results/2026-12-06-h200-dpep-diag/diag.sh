#!/usr/bin/env bash
# Diagnose the DP2 EP2 bench hang: which shapes hang, and where rank 0's thread is.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"; cd "$root"
bash scripts/unpack-models.sh >/dev/null 2>&1
tar -xJf .gpupack/d/bin.tar.xz -C .gpupack && mkdir -p .gpupack/diagbin && xz -dc .gpupack/d/diagrelay.xz > .gpupack/diagbin/relay && chmod +x .gpupack/diagbin/relay
source scripts/gpu-prebuilt.sh; use_prebuilt .gpupack/bin
export CUDA_MODULE_LOADING=EAGER
which gdb eu-stack pstack 2>&1 | head -3
"$bin/relay" make-model --preset 30b-a3b --layers 12 --config-only --out /tmp/cfg12 | tail -1
case_() {
  local name="$1" model="$2"; shift 2
  echo "== $name"
  timeout 40 "$bin/relay" bench --mode model --model "$model" "$@" --dp 2 --ep 2 --gpus 0,0 \
    --max-num-batched-tokens 2048 --decode-contexts 512 --out "$OUT/diag.jsonl" > "$OUT/diag-$name.log" 2>&1 &
  local pid=$!
  sleep 7
  if kill -0 $pid 2>/dev/null && command -v gdb >/dev/null; then
    gdb -p "$(pgrep -f 'relay bench' | head -1)" -batch -ex "thread apply all bt 30" > "$OUT/gdb-$name.txt" 2>&1
    grep -c "" "$OUT/gdb-$name.txt"
  fi
  if kill -0 $pid 2>/dev/null; then
    rp="$(pgrep -f 'relay bench' | head -1)"
    for t in /proc/$rp/task/*; do
      echo "$(basename $t) $(cat $t/comm) wchan=$(cat $t/wchan 2>/dev/null) sys=$(cut -d' ' -f1 $t/syscall 2>/dev/null) state=$(awk '{print $3}' $t/stat)"
    done > "$OUT/threads-$name.txt"
    nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader >> "$OUT/threads-$name.txt"
    cat "$OUT/threads-$name.txt" | awk '{print $2, $3, $4, $5}' | sort | uniq -c | sort -rn | head -12
  fi
  wait $pid; echo "rc $?"; grep -v '"ops"' "$OUT/diag-$name.log" | tail -3 | cut -c1-400
}
case_ cfg12-p512 /tmp/cfg12 --load-format dummy --prefill-lengths 512 --decode-batches 1
case_ demo-p512 models/relay-demo-moe --prefill-lengths 512 --decode-batches 1
case_ cfg12-p16 /tmp/cfg12 --load-format dummy --prefill-lengths 16 --decode-batches 2
echo done
if [ -x .gpupack/diagbin/relay ]; then
  for mode in 1 sync; do
    echo "== trace $mode"
    RELAY_TRACE_OPS=$mode timeout 40 .gpupack/diagbin/relay bench --mode model --model /tmp/cfg12 --load-format dummy \
      --prefill-lengths 512 --decode-batches 1 --dp 2 --ep 2 --gpus 0,0 --max-num-batched-tokens 2048 \
      --decode-contexts 512 --out "$OUT/trace.jsonl" > "$OUT/trace-$mode.log" 2>&1
    echo "rc $?"
    grep -v '"ops"' "$OUT/trace-$mode.log" | grep -v "^trace" | tail -4 | cut -c1-300
    for r in 0 1; do echo "rank $r last:"; grep "^trace rank $r:" "$OUT/trace-$mode.log" | tail -4; done
    xz -f "$OUT/trace-$mode.log"
  done
fi
echo all done

#!/usr/bin/env bash
# The GPU machine's one command: build (or take a prebuilt CUDA build), run every GPU test, then a
# benchmark — ceilings, kernels, collectives, PyTorch's peers, and prefill/decode (bf16 and FP8; two
# sharded layouts with their ranks sharing the GPU; the full 48-layer 30B-A3B with dummy weights) plus
# FP8-vs-bf16 logits and Relay-vs-transformers logits (bf16 and FP8, bench/hf_compare.py) on the
# 12-layer benchmark model (made on the machine with `relay make-model --preset 30b-a3b --layers 12`).
#
#   scripts/gpu-check.sh --pack DIR [BUILD]  (here, with nvcc and Relay's -dev packages) builds BUILD
#                                       (default build-cuda/) for sm_90a and copies relay, test_gpu and
#                                       the shared libraries the GPU machine lacks into DIR
#   scripts/gpu-check.sh [--prebuilt DIR] [--full] [--no-model] [--tests-only] [--results FILE]
#                                       (on the GPU machine) without --prebuilt it builds build-gpu/;
#                                       --full runs every bench shape (default --quick); --no-model
#                                       skips the model benchmark; --tests-only stops after the GPU
#                                       tests; results are appended to FILE
#                                       (default bench/results/<date>-h200.jsonl) and, when $OUT is set,
#                                       copied there with the logs.
# The GPU machine has no network and lacks Relay's Debian -dev packages, so the usual route is
# --pack here and --prebuilt DIR there (DIR travels with the device call's `carry`).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export PATH=/usr/local/cuda/bin:$PATH

if [ "${1:-}" = "--pack" ]; then
  dir="${2:?--pack needs a directory}"
  build="${3:-build-cuda}"  # an existing sm_90a Release build (build/ here) saves a full CUDA compile
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a >/dev/null
  # The GPU test log names the commit it tested, so the tree built must be that commit.
  if ! git -C "$root" diff --quiet HEAD -- src tests cmake CMakeLists.txt scripts; then
    echo "gpu-check --pack: uncommitted changes under src, tests, cmake or scripts; commit first" >&2
    exit 2
  fi
  cmake --build "$build" --target relay test_gpu -j "${RELAY_BUILD_JOBS:-$(nproc)}"
  rm -rf "$dir" && mkdir -p "$dir/lib"
  git -C "$root" rev-parse HEAD > "$dir/commit"
  cp "$build/relay" "$build/tests/test_gpu" "$dir/"
  # Libraries outside the CUDA toolkit and the C runtime that Ubuntu 24.04 may lack.
  ldd "$build/relay" | awk '/=>/ {print $3}' | grep -E 'httplib|pcre2|utf8proc|brotli|libuc[mpst]\.so|libnuma' |
    xargs -r cp -L -t "$dir/lib/"
  # UCX loads its transports as plugins from <libucs dir>/ucx.
  ucs="$(ldd "$build/relay" | awk '/libucs\.so/ {print $3}')"
  if [ -n "$ucs" ]; then
    mkdir -p "$dir/lib/ucx" && cp -L "$(dirname "$ucs")"/ucx/*.so.0 "$dir/lib/ucx/"
  fi
  echo "$root" > "$dir/source_dir"  # the tests' compiled-in RELAY_SOURCE_DIR
  echo "packed into $dir"
  exit 0
fi

prebuilt="" full=0 model=1 tests_only=0 results=""
while [ $# -gt 0 ]; do
  case "$1" in
    --prebuilt) prebuilt="$2"; shift 2 ;;
    --full) full=1; shift ;;
    --no-model) model=0; shift ;;
    --tests-only) tests_only=1; shift ;;
    --results) results="$2"; shift 2 ;;
    *) echo "gpu-check: unknown argument $1" >&2; exit 2 ;;
  esac
done
logs="${OUT:-$root/build-gpu-logs}"
mkdir -p "$logs"
results="${results:-bench/results/$(date -u +%Y-%m-%d)-h200.jsonl}"
mkdir -p "$(dirname "$results")"

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
bash scripts/unpack-models.sh

if [ -n "$prebuilt" ]; then
  source scripts/gpu-prebuilt.sh
  use_prebuilt "$prebuilt"
else
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a >/dev/null
  cmake --build build-gpu --target relay test_gpu -j "$(nproc)"
  bin="$root/build-gpu"
  cp build-gpu/tests/test_gpu "$bin/test_gpu" 2>/dev/null || true
fi

echo "== GPU tests"
# The log to commit: bench/results/gpu-tests/<date>-<commit12>-<device>.log, its first line
# `commit <full sha>` of the tree the binaries were built from.
commit="$(cat "$bin/commit" 2>/dev/null || git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)"
device="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE '[abgh][0-9]{2,3}' | head -1 |
  tr '[:upper:]' '[:lower:]')"
mkdir -p "$logs/gpu-tests"
test_log="$logs/gpu-tests/$(date -u +%Y-%m-%d)-${commit:0:12}-${device:-gpu}.log"
echo "commit $commit" > "$test_log"
set +e
"$bin/test_gpu" --gtest_brief=1 2>&1 | tee -a "$test_log"
tests_rc=${PIPESTATUS[0]}
set -e
echo "== GPU tests exit code $tests_rc"
[ "$tests_only" = 1 ] && exit "$tests_rc"

quick="--quick"; [ "$full" = 1 ] && quick=""
echo "== relay bench (ceilings, kernels)"
"$bin/relay" bench --mode kernels $quick --out "$results" 2>&1 | tee "$logs/bench-kernels.log"
echo "== relay bench (collectives: peers emulated on this one GPU unless several are present)"
"$bin/relay" bench --mode collectives --quick --ranks "$(nvidia-smi -L | wc -l)" --out "$results" 2>&1 |
  tee "$logs/bench-collectives.log"
echo "== PyTorch peers"
PYTHONUNBUFFERED=1 python3 bench/torch_peers.py $quick --out "$results" 2>&1 | tee "$logs/torch-peers.log" || true

if [ "$model" = 1 ]; then
  mdir=/tmp/relay-bench-30b-a3b-12l
  if [ ! -f "$mdir/config.json" ]; then
    echo "== make-model"
    /usr/bin/time -f "make-model %e s" "$bin/relay" make-model --preset 30b-a3b --layers 12 --out "$mdir" 2>&1 | tail -3
  fi
  # Load speed is compared with reading the same files with cat, both from a cold page cache.
  sync; echo 3 > /proc/sys/vm/drop_caches || true
  python3 - "$mdir" "$results" <<'PY'
import glob, json, os, subprocess, sys, time
files = sorted(glob.glob(os.path.join(sys.argv[1], "*.safetensors")))
t0 = time.time(); subprocess.run(["cat"] + files, stdout=subprocess.DEVNULL, check=True); dt = time.time() - t0
nbytes = sum(os.path.getsize(f) for f in files)
line = json.dumps({"mode": "cat", "bytes": nbytes, "seconds": dt, "gbps": nbytes / dt / 1e9})
print(line); open(sys.argv[2], "a").write(line + "\n")
PY
  sync; echo 3 > /proc/sys/vm/drop_caches || true
  echo "== relay bench (model, bf16 and FP8)"
  "$bin/relay" bench --mode model $quick --model "$mdir" --out "$results" 2>&1 | tee "$logs/bench-model.log"
  "$bin/relay" bench --mode model $quick --dtype fp8 --model "$mdir" --out "$results" 2>&1 |
    tee "$logs/bench-model-fp8.log"
  echo "== sharded ranks sharing this GPU (correct and finishing, not scaling): TP 2 + EP 2, DP 2 + EP 2"
  for layout in "--tp 2 --ep 2" "--dp 2 --ep 2"; do
    # shellcheck disable=SC2086
    "$bin/relay" bench --mode model --model "$mdir" $layout --gpus 0,0 --max-num-batched-tokens 2048 \
      --prefill-lengths 512,2048 --decode-batches 1,8,64 --decode-contexts 512 --out "$results" 2>&1 |
      tee -a "$logs/bench-sharded.log" || true
  done
  echo "== dummy weights (--load-format dummy): Qwen3-30B-A3B's 48 layers, never written to disk"
  cfg=/tmp/relay-30b-a3b-config
  [ -f "$cfg/config.json" ] || "$bin/relay" make-model --preset 30b-a3b --config-only --out "$cfg" | tail -1
  "$bin/relay" bench --mode model --model "$cfg" --load-format dummy --prefill-lengths 4096 \
    --decode-batches 1,64 --decode-contexts 1024 --out "$results" 2>&1 | tee "$logs/bench-dummy.log" || true
  echo "== relay bench (FP8 vs bf16 logits)"
  "$bin/relay" bench --mode accuracy --model "$mdir" --out "$results" 2>&1 | tee "$logs/bench-accuracy.log"
  echo "== Relay vs transformers logits (bf16; FP8 against transformers' own FP8 execution)"
  qdir=/tmp/relay-bench-30b-a3b-12l-fp8
  if [ ! -f "$qdir/config.json" ]; then
    "$bin/relay" quantize --in "$mdir" --out "$qdir" --format fp8-block128 2>&1 | tail -1 || true
  fi
  PYTHONUNBUFFERED=1 python3 bench/hf_compare.py --model "$mdir" --fp8 "$qdir" --relay "$bin/relay" --out "$results" 2>&1 |
    tee "$logs/hf-compare.log" || true
fi
cp "$results" "$logs/" 2>/dev/null || true
echo "== done: GPU tests exit code $tests_rc; results in $results"
exit "$tests_rc"

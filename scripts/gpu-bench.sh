#!/usr/bin/env bash
# The GPU session driver: on the device machine, unpacks the binaries `scripts/gpu-check.sh --pack`
# made (packed further with xz, as the device tool carries at most 64 MiB with the tree), runs the
# GPU tests and then the named benchmarks, each `relay bench` run's output appended to
# $OUT/bench-<group>.log. Here, before the call:
#
#   rm -rf .gpupack/bin && scripts/gpu-check.sh --pack .gpupack/bin build
#   strip .gpupack/bin/relay .gpupack/bin/test_gpu
#   mkdir -p .gpupack/c && XZ_OPT=-9e tar -C .gpupack -cJf .gpupack/c/bin.tar.xz bin
#
# and on the device machine (carry [".gpupack/c"]): scripts/gpu-bench.sh [tests] MODE...
# The tree (about 59 MiB counted in 4 KiB blocks) plus that pack (about 6 MiB) can pass the 64 MiB;
# then pack the test binary and relay apart and carry one a call, back to back while the machine
# is warm: `(cd .gpupack && XZ_OPT=-9e tar -cJf t/tests.tar.xz --exclude=bin/relay bin &&
# XZ_OPT=-9e tar -cJf r/relay.tar.xz --exclude=bin/test_gpu bin)` after `mkdir -p .gpupack/t
# .gpupack/r`, then RELAY_GPU_PACK=.gpupack/t/tests.tar.xz scripts/gpu-bench.sh tests (carry
# [".gpupack/t"]) and RELAY_GPU_PACK=.gpupack/r/relay.tar.xz scripts/gpu-bench.sh MODE...
# Or carry one pack in one call (no second start to wait for) by moving files the device machine
# does not read out of the tree for that call: bench/results and tests/unit (sources the packed
# test binary already holds) are about 2.8 MiB; move them back before the next commit.
# A same-machine baseline: build relay at the older commit in a worktree (`git worktree add
# /tmp/before REV`, `.deps` linked from this checkout), pack it alone as .gpupack/b/relay.tar.xz
# (bin/relay inside) and run the same modes with RELAY_GPU_PACK pointing at it, right after.
# Modes: single dp2ep2 tp2ep2 dp2ep2-default dp4ep4 (sharded layouts on the 12-layer 30B-A3B
# shape); plain48 trace48 (the 48-layer shape); spec1 spec2 spec3 spec1dp (K-draft verify steps at
# forced acceptance 0.8); decode-curve (bf16 and FP8 decode against batch); gdn-kernels, gdn-model,
# q35, attn-quick (Qwen3.5 shapes and kernels); grouped-model (prefill on either grouped GEMM);
# q35-mtp, b256, spec-adapt, hybrid-dpep (MTP and min_draft_acceptance through the engine); compare
# (bin/before/relay against this one); demo-engine, hybrid, hybrid-bench; ncu (NCU_KERNEL=REGEX:
# Nsight Compute sections of those kernels in the kernel bench); tidy (drops tests.log from $OUT).
# A bin/before directory in the pack holds an older relay for the before/after modes (SIDES picks
# the sides; in gdn-model any other side NAME runs bin/NAME/relay; FULL=0 skips gdn-model's
# full-depth FP8 run).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"; cd "$root"
pack="${RELAY_GPU_PACK:-.gpupack/c/bin.tar.xz}"
rm -rf .gpupack/bin; tar -C .gpupack -xJf "$pack"
t0=$(date +%s)
if [ "$1" = tests ]; then
  timeout 400 bash scripts/gpu-check.sh --prebuilt .gpupack/bin --tests-only > "$OUT/tests.log" 2>&1
  echo "tests rc $? in $(( $(date +%s) - t0 )) s"; grep -E "FAILED|PASSED|tests from" "$OUT/tests.log" | tail -15
  [ "$#" -gt 1 ] || exit 0; shift
fi
source scripts/gpu-prebuilt.sh; use_prebuilt .gpupack/bin
"$bin/relay" make-model --preset 30b-a3b --layers 12 --config-only --out /tmp/cfg12 | tail -1
"$bin/relay" make-model --preset 30b-a3b --config-only --out /tmp/q30 | tail -1
"$bin/relay" make-model --preset 30b-a3b --layers 24 --config-only --out /tmp/q30h | tail -1
"$bin/relay" make-model --preset qwen3.5-35b-a3b --layers 8 --config-only --out /tmp/q35 | tail -1
"$bin/relay" make-model --preset qwen3.5-35b-a3b --layers 16 --config-only --out /tmp/q35m | tail -1
# run NAME ARGS...: relay bench ARGS, its output appended to $OUT/bench-$GROUP.log (GROUP defaults
# to NAME; few files come back from $OUT), each run headed by its name and arguments.
run() {
  local name="$1"; shift
  local f="$OUT/bench-${GROUP:-$name}.log"
  echo "== $name"; echo "== $name: relay bench $*" >> "$f"
  timeout "${LIMIT:-150}" "${RELAY:-$bin/relay}" bench "$@" > /tmp/run.log 2>&1
  echo "rc $? at $(( $(date +%s) - t0 )) s"; cat /tmp/run.log >> "$f"
  grep -v '"profile"' /tmp/run.log | grep -v '"mode":"load"' | tail -4 | cut -c1-500
}
M12="--mode model --model /tmp/cfg12 --load-format dummy --prefill-lengths 512 --decode-batches 1,8 --decode-contexts 512"
M30="--mode model --model /tmp/q30 --load-format dummy --prefill-lengths 512 --decode-batches 1,8,64 --decode-contexts 512"
M24="--mode model --model /tmp/q30h --load-format dummy --prefill-lengths 512 --decode-batches 1,8,64 --decode-contexts 512"
for l in "$@"; do
  case $l in
    single) run single $M12 --max-num-batched-tokens 2048 ;;
    dp2ep2) run dp2ep2 $M12 --dp 2 --ep 2 --gpus 0,0 --max-num-batched-tokens 2048 ;;
    tp2ep2) run tp2ep2 $M12 --tp 2 --ep 2 --gpus 0,0 --max-num-batched-tokens 2048 ;;
    dp2ep2-default) run dp2ep2-default $M12 --dp 2 --ep 2 --gpus 0,0 ;;
    dp4ep4) run dp4ep4 $M12 --dp 4 --ep 4 --gpus 0,0,0,0 --max-num-batched-tokens 2048 ;;
    spec1dp) run spec1dp $M12 --dp 2 --ep 2 --gpus 0,0 --max-num-batched-tokens 2048 --spec-forced-acceptance 0.8 \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 1}' ;;
    plain48) run plain48 $M30 --max-num-batched-tokens 2048 ;;
    trace48) RELAY_TRACE_OPS=1 LIMIT=60 run trace48 $M30 --max-num-batched-tokens 2048
      grep -c "relay trace" "$OUT/bench-trace48.log"; grep "relay trace" "$OUT/bench-trace48.log" | tail -3
      grep -v "relay trace" "$OUT/bench-trace48.log" > /tmp/t48; tail -c 2000 /tmp/t48
      tail -400 "$OUT/bench-trace48.log" > /tmp/t; mv /tmp/t "$OUT/bench-trace48.log" ;;
    spec1|spec2|spec3) run $l $M24 --max-num-batched-tokens 2048 --spec-forced-acceptance 0.8 \
        --speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": ${l#spec}}" ;;
    compare)  # issue 24: the 12-layer model before (bin/before/relay) and after, interleaved
      for round in 1 2; do
        for side in before after; do
          b="$bin/relay"; [ $side = before ] && b="$bin/before/relay"
          echo "== compare $side $round"
          timeout 200 "$b" bench --mode model --model /tmp/cfg12 --load-format dummy --prefill-lengths 512,4096 \
            --decode-batches 1,8,64,256 --decode-contexts 512 > "$OUT/cmp-$side-$round.log" 2>&1
          echo "rc $? at $(( $(date +%s) - t0 )) s"
          grep -v '"profile"' "$OUT/cmp-$side-$round.log" | grep -o '"mode":"[a-z]*"\|"batch":[0-9]*\|"context":[0-9]*\|"ms_per_step":[0-9.]*' | paste -sd' ' | cut -c1-600
        done
      done ;;
    hybrid)  # issue 25: the demo hybrid on both devices (greedy text), then through the engine bench
      bash scripts/unpack-models.sh > /dev/null 2>&1
      P="def fibonacci(n):"
      for dev in cpu cuda; do
        timeout 120 "$bin/relay" generate --model models/relay-demo-hybrid --device $dev --prompt "$P" \
          --max-tokens 48 > "$OUT/hybrid-generate-$dev.txt" 2> "$OUT/hybrid-generate-$dev.err"
        echo "generate $dev rc $?"; tail -2 "$OUT/hybrid-generate-$dev.err"
      done
      cmp "$OUT/hybrid-generate-cpu.txt" "$OUT/hybrid-generate-cuda.txt" && echo "hybrid generate: same text on cpu and cuda"
      timeout 120 "$bin/relay" generate --model models/relay-demo-hybrid --device cuda --prompt "$P" --max-tokens 48 \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}' > "$OUT/hybrid-generate-cuda-ngram.txt" \
        2> "$OUT/hybrid-generate-cuda-ngram.err"
      echo "generate cuda ngram rc $?"; tail -1 "$OUT/hybrid-generate-cuda-ngram.err"
      cmp "$OUT/hybrid-generate-cuda-ngram.txt" "$OUT/hybrid-generate-cuda.txt" && echo "hybrid generate: n-gram the same text"
      timeout 120 "$bin/relay" generate --model models/relay-demo-hybrid --device cuda --prompt "$P" --max-tokens 48 \
        --speculative-config '{"method": "mtp", "num_speculative_tokens": 2}' > "$OUT/hybrid-generate-cuda-mtp.txt" \
        2> "$OUT/hybrid-generate-cuda-mtp.err"
      echo "generate cuda mtp rc $?"; tail -1 "$OUT/hybrid-generate-cuda-mtp.err"
      cmp "$OUT/hybrid-generate-cuda-mtp.txt" "$OUT/hybrid-generate-cuda.txt" && echo "hybrid generate: MTP the same text"
      timeout 240 python3 bench/disagg_check.py --relay "$bin/relay" --device cuda --model models/relay-demo-hybrid \
        --num-kv-blocks 2048 --long-prompt 1500 --decode-args "--tp 2 --gpus 0,0" --out "$OUT/disagg-hybrid.jsonl" \
        > "$OUT/disagg-hybrid.log" 2>&1
      echo "disagg hybrid rc $?"; tail -6 "$OUT/disagg-hybrid.log" | cut -c1-300
      run hybrid-engine --mode engine --device cuda --model models/relay-demo-hybrid --decode-batches 1,8,64 --decode-contexts 128 --decode-tokens 128
      run hybrid-engine-ngram --mode engine --device cuda --model models/relay-demo-hybrid --decode-batches 1,8 --decode-contexts 128 --decode-tokens 128 \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'
      for k in 1 3; do
        run hybrid-engine-mtp$k --mode engine --device cuda --model models/relay-demo-hybrid --decode-batches 1,8 --decode-contexts 128 \
          --decode-tokens 128 --speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": $k}"
      done ;;
    hybrid-bench)  # the demo hybrid through the engine bench only: plain, n-gram, MTP K = 1, 3
      bash scripts/unpack-models.sh > /dev/null 2>&1
      export GROUP=hybrid-engine
      run hybrid-engine --mode engine --device cuda --model models/relay-demo-hybrid --decode-batches 1,8,64 --decode-contexts 128 --decode-tokens 128
      run hybrid-engine-ngram --mode engine --device cuda --model models/relay-demo-hybrid --decode-batches 1,8 --decode-contexts 128 --decode-tokens 128 \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'
      for s in '' '--speculative-config {"method":"ngram","num_speculative_tokens":3}'; do  # a code edit
        run hybrid-engine-code-edit --mode engine --device cuda --model models/relay-demo-hybrid --decode-batches 1 \
          --prompt-file bench/prompts/code-edit.py --decode-tokens 128 $s
      done
      for k in 1 3; do
        run hybrid-engine-mtp$k --mode engine --device cuda --model models/relay-demo-hybrid --decode-batches 1,8,64 --decode-contexts 128 \
          --decode-tokens 128 --speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": $k}"
      done
      for s in '' '--speculative-config {"method":"mtp","num_speculative_tokens":1}'; do
        run hybrid-engine-eager --mode engine --device cuda --model models/relay-demo-hybrid --decode-batches 1,8 --decode-contexts 128 \
          --decode-tokens 128 --enforce-eager $s
      done; unset GROUP ;;
    hybrid-dpep)  # issue 26: the demo hybrid on DP 2 + EP 2 (both ranks on GPU 0), plain and MTP K = 1, 3
      bash scripts/unpack-models.sh > /dev/null 2>&1
      export GROUP=hybrid-dpep
      D="--mode engine --device cuda --model models/relay-demo-hybrid --dp 2 --ep 2 --gpus 0,0 --decode-batches 2,16 --decode-contexts 128 --decode-tokens 128"
      run dpep-plain $D
      for k in 1 3; do
        run dpep-mtp$k $D --speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": $k}"
      done; unset GROUP ;;
    q35-mtp)  # issue 26: Qwen3.5-35B-A3B's first 16 layers and its MTP head (dummy weights), through
      # the engine, plain and with MTP K = 1, 3 at a forced acceptance of 0.8
      export GROUP=q35-mtp
      E="--mode engine --device cuda --model /tmp/q35m --load-format dummy --decode-batches 1,8,64 --decode-contexts 512 --decode-tokens 64"
      LIMIT=150 run q35m-plain $E
      for k in 1 3; do
        LIMIT=150 run q35m-mtp$k $E --spec-forced-acceptance 0.8 \
          --speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": $k}"
      done; unset GROUP ;;
    b256)  # issue 26: batch 256, the demo hybrid and Qwen3.5-35B-A3B's first 16 layers, plain and MTP
      bash scripts/unpack-models.sh > /dev/null 2>&1
      export GROUP=b256
      D="--mode engine --device cuda --model models/relay-demo-hybrid --decode-batches 256 --decode-contexts 128 --decode-tokens 64"
      Q="--mode engine --device cuda --model /tmp/q35m --load-format dummy --decode-batches 256 --decode-contexts 512 --decode-tokens 32"
      run demo-plain $D
      run demo-mtp1 $D --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'
      run q35m-plain $Q
      run q35m-mtp1 $Q --spec-forced-acceptance 0.8 --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'
      unset GROUP ;;
    tidy) rm -f "$OUT/tests.log" ;;
    ncu)  # Nsight Compute on the kernel bench: the first NCU_COUNT (2) launches of the kernels whose
      # names match NCU_KERNEL (a regex): speed of light, memory, scheduler and warp states.
      # NCU_SKIP (0) matching launches are skipped first (the warm-up's). NCU_BENCH replaces the
      # bench's arguments, e.g. a 2048-token prefill chunk of Qwen3.5 (the models above) through
      # the engine: NCU_BENCH="--mode engine --device cuda --model /tmp/q35 --load-format dummy
      # --decode-batches 1 --decode-contexts 4096 --decode-tokens 4" NCU_KERNEL=causal_conv1d
      # NCU_SKIP=6. (The model mode's KV pool takes the memory ncu saves buffers in for its
      # replays: "Failed to profile" there.) NCU_ARGS adds ncu options, e.g. "--section
      # SourceCounters" for the instructions warps stall on (what the Gated DeltaNet prepare
      # kernel's 0.31 issued a cycle waits for is the open question); NCU_LINES (80) of the report
      # are printed, all of it is in ncu.txt. NCU_SOURCE=1 also saves the report and exports its
      # per-instruction page (SASS, with the warp stall samples of each instruction; the
      # SourceCounters section collects them) as ncu-source.csv.xz: which instructions the
      # warps wait on, where the summary sections only say how long.
      ncu=/usr/local/cuda/bin/ncu
      report=(); [ "${NCU_SOURCE:-0}" = 1 ] && report=(-f -o /tmp/ncu-report --import-source no)
      # shellcheck disable=SC2086  # NCU_BENCH and NCU_ARGS are lists of arguments
      timeout 240 "$ncu" -k "regex:${NCU_KERNEL:?NCU_KERNEL names the kernels}" \
        -s "${NCU_SKIP:-0}" -c "${NCU_COUNT:-2}" --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section SchedulerStats --section WarpStateStats --section Occupancy ${NCU_ARGS:-} \
        "${report[@]}" "$bin/relay" bench ${NCU_BENCH:---mode kernels --quick} > "$OUT/ncu.txt" 2>&1
      echo "ncu rc $?"
      if [ "${NCU_SOURCE:-0}" = 1 ]; then  # with -o the report is not printed: print it from the file
        "$ncu" --import /tmp/ncu-report.ncu-rep --page details >> "$OUT/ncu.txt" 2>&1
        "$ncu" --import /tmp/ncu-report.ncu-rep --page source --csv --print-source sass \
          2>&1 | xz -9 > "$OUT/ncu-source.csv.xz"
        echo "source page rc ${PIPESTATUS[0]}"
      fi
      grep -v '^{' "$OUT/ncu.txt" | grep -v '^    INF\|^          ' | head -"${NCU_LINES:-80}" | cut -c1-160 ;;
    decode-curve)  # issue 27: decode tok/s against batch, bf16 and FP8, on the 12-layer 30B-A3B shape
      export GROUP=decode-curve
      for dt in bf16 fp8; do
        LIMIT=150 run decode-$dt --mode model --model /tmp/cfg12 --load-format dummy --dtype $dt --prefill-lengths 512 \
          --decode-batches 1,8,64,256 --decode-contexts 512 --max-num-batched-tokens 2048
      done; unset GROUP ;;
    gdn-kernels)  # issue 25: the chunked Gated DeltaNet form: its kernel lines, flash-linear-attention on the
      # same shapes, Qwen3.5-35B-A3B's first 8 layers before (bin/before/relay: decode form only) and
      # after, then at full depth in FP8
      export GROUP=gdn
      LIMIT=300 run kernels --mode kernels
      grep '"gated_delta_rule"' "$OUT/bench-gdn.log" | cut -c1-330
      unset GROUP ;;
    attn-quick)  # issues 25 / 27: the kernel lines (--quick), prefill attention at head_dim 128 and 256 on both kernels,
      # and Gated DeltaNet's decode step fused and as three ops
      export GROUP=attn
      LIMIT=150 run kernels-quick --mode kernels --quick
      grep '"moe_grouped_gemm_prefill"' "$OUT/bench-attn.log" | grep -o '"shape":"[a-z0-9_]*"\|"variant":"[a-z_]*"\|"ms":[0-9.]*\|"fraction_of_dense":[0-9.]*' | paste -d' ' - - - -
      grep '"prefill_attention"' "$OUT/bench-attn.log" | cut -c1-300
      grep '"gated_delta_net_step"' "$OUT/bench-attn.log" | cut -c1-300
      unset GROUP ;;
    grouped-model)  # issues 25 / 27: prefill with the grouped GEMM on CUTLASS's kernel and on the wgmma
      # one (RELAY_MOE_PREFILL_GEMM), the 12-layer 30B-A3B shape and Qwen3.5-35B-A3B's first 8 layers
      export GROUP=grouped-model
      for g in cutlass_cooperative wgmma; do
        RELAY_MOE_PREFILL_GEMM=$g LIMIT=120 run q30-12l-$g --mode model --model /tmp/cfg12 --load-format dummy \
          --prefill-lengths 512,4096,16384 --decode-batches 1 --decode-contexts 512
        RELAY_MOE_PREFILL_GEMM=$g LIMIT=120 run q35-8l-$g --mode model --model /tmp/q35 --load-format dummy \
          --prefill-lengths 512,4096 --decode-batches 1 --decode-contexts 512
      done
      grep '"mode":"prefill"\|^== ' "$OUT/bench-grouped-model.log" | grep -o '^== [a-z0-9_-]*\|"tokens":[0-9]*\|"ms_per_step":[0-9.]*\|"roofline_fraction":[0-9.e-]*' \
        | paste -sd' ' | sed 's/== /\n== /g'
      unset GROUP ;;
    gdn-model)
      export GROUP=gdn-model
      for side in ${SIDES:-before after}; do
        RELAY="$bin/relay"; [ "$side" = after ] || RELAY="$bin/$side/relay"  # e.g. bin/before/relay
        RELAY=$RELAY LIMIT=150 run q35-8l-$side --mode model --model /tmp/q35 --load-format dummy --prefill-lengths 512,4096 \
          --decode-batches 1,64 --decode-contexts 512
        grep '"mode":"prefill"' /tmp/run.log | grep -o '"tokens":[0-9]*\|"ms_per_step":[0-9.]*\|"roofline_fraction":[0-9.e-]*' | paste -sd' '
      done
      [ "${FULL:-1}" = 1 ] || { unset GROUP; continue; }
      "$bin/relay" make-model --preset qwen3.5-35b-a3b --config-only --out /tmp/q35full | tail -1
      LIMIT=240 run q35-full-fp8 --mode model --model /tmp/q35full --load-format dummy --dtype fp8 --prefill-lengths 4096 \
        --decode-batches 1,64 --decode-contexts 512
      grep -v '"profile"' /tmp/run.log | tail -4 | cut -c1-400; unset GROUP ;;
    q35)  # issue 25: Qwen3.5-35B-A3B shapes (first 8 layers, dummy weights) in the model mode, fractions of the limits
      export GROUP=q35
      LIMIT=200 run q35-8l --mode model --model /tmp/q35 --load-format dummy --prefill-lengths 512,4096 \
        --decode-batches 1,8,64 --decode-contexts 512
      LIMIT=120 run single12 $M12 --max-num-batched-tokens 2048; unset GROUP ;;
    spec-adapt)  # issue 26: min_draft_acceptance through the engine, 12-layer 30B-A3B shape, n-gram K = 3
      # at a forced acceptance of 0.2 and 0.8, with and without it
      export GROUP=spec-adapt
      E12="--mode engine --device cuda --model /tmp/cfg12 --load-format dummy --decode-batches 1,64 --decode-contexts 512 --decode-tokens 64"
      LIMIT=90 run plain $E12
      for p in 0.2 0.8; do
        LIMIT=90 run always-$p $E12 --spec-forced-acceptance $p \
          --speculative-config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
        LIMIT=90 run adaptive-$p $E12 --spec-forced-acceptance $p \
          --speculative-config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "min_draft_acceptance": 0.3}'
      done
      grep -o '"batch":[0-9]*\|"tok_per_s":[0-9.]*\|"acceptance_rate":[0-9.]*\|== [a-z0-9.-]*' "$OUT/bench-spec-adapt.log" | paste -sd' ' | sed 's/== /\n== /g'
      unset GROUP ;;
    demo-engine)
      run demo-plain --mode engine --model models/relay-demo-moe --decode-batches 1,8 --decode-contexts 128 --decode-tokens 256
      run demo-ngram --mode engine --model models/relay-demo-moe --decode-batches 1,8 --decode-contexts 128 --decode-tokens 256 \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}' ;;
  esac
done
echo "== all done in $(( $(date +%s) - t0 )) s"

#!/usr/bin/env bash
# Unpacks the embedded models (their weights, and relay-demo-moe's tokenizer, ship xz-compressed) and
# the tokenizer conformance corpus (tests/fixtures/tokenizer), and checks each file against its
# .sha256. Idempotent: files that are already there and correct are left alone. relay-demo-hybrid
# uses the same tokenizer (Qwen3's), which ships once, with relay-demo-moe.
set -euo pipefail
models="$(cd "$(dirname "$0")/.." && pwd)/models"
moe="$models/relay-demo-moe"
hybrid="$models/relay-demo-hybrid"

# unpack DIR FILE COMMAND...: writes DIR/FILE from COMMAND's stdout unless it matches DIR/FILE.sha256.
unpack() {
  local dir="$1" f="$2"
  shift 2
  if [ -f "$dir/$f" ] && (cd "$dir" && sha256sum --quiet -c "$f.sha256" 2>/dev/null); then
    return
  fi
  "$@" > "$dir/$f.tmp"
  mv "$dir/$f.tmp" "$dir/$f"
  (cd "$dir" && sha256sum --quiet -c "$f.sha256")
}

unpack "$moe" model.safetensors xz -dc "$moe/model.safetensors.xz"
unpack "$moe" tokenizer.json xz -dc "$moe/tokenizer.json.xz"
unpack "$hybrid" model.safetensors xz -dc "$hybrid/model.safetensors.xz"
unpack "$hybrid" tokenizer.json cat "$moe/tokenizer.json"
corpus="$models/../tests/fixtures/tokenizer"
unpack "$corpus" corpus.json xz -dc "$corpus/corpus.json.xz"

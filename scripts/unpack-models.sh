#!/usr/bin/env bash
# Unpacks the embedded default model (weights and tokenizer ship xz-compressed) and checks their
# sha256. Idempotent: files that are already there and correct are left alone.
set -euo pipefail
dir="$(cd "$(dirname "$0")/.." && pwd)/models/relay-demo-moe"
for f in model.safetensors tokenizer.json; do
  if [ -f "$dir/$f" ] && (cd "$dir" && sha256sum --quiet -c "$f.sha256" 2>/dev/null); then
    continue
  fi
  xz -dc "$dir/$f.xz" > "$dir/$f.tmp"
  mv "$dir/$f.tmp" "$dir/$f"
  (cd "$dir" && sha256sum --quiet -c "$f.sha256")
done

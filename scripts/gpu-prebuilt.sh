# Sourced by the GPU scripts: use_prebuilt DIR sets `bin` to a directory packed by
# `scripts/gpu-check.sh --pack`, puts its libraries on the loader path, and makes the source path
# the binaries were built in (their fixtures and default model) point at this checkout ($root).
use_prebuilt() {
  bin="$(cd "${1:?--prebuilt DIR is required (scripts/gpu-check.sh --pack DIR makes it)}" && pwd)"
  export LD_LIBRARY_PATH="$bin/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
  local built_in
  built_in="$(cat "$bin/source_dir")"
  if [ "$built_in" != "$root" ] && [ ! -e "$built_in" ]; then
    mkdir -p "$(dirname "$built_in")" && ln -s "$root" "$built_in"
  fi
}

#!/usr/bin/env bash
# Installs everything Relay needs to build and test on a fresh Debian 12 machine (and Ubuntu 24.04).
# Pinned versions; safe to run twice (apt and pip skip what is already installed).
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

# Debian packages: build tools and C++ libraries. Versions are those of Debian 12 (bookworm).
APT_PACKAGES=(
  cmake ninja-build g++ pkg-config xz-utils
  libgtest-dev            # unit tests (GoogleTest via CTest)
  nlohmann-json3-dev      # JSON for configs, safetensors headers, the HTTP API
  libpcre2-dev            # the tokenizer's split regex (Unicode classes, look-ahead)
  libutf8proc-dev         # NFC normalisation
  libcpp-httplib-dev      # HTTP server and client
  libcli11-dev            # command line
  libssl-dev zlib1g-dev   # cpp-httplib's link dependencies
  libucx-dev              # UCX 1.13 (UCP): the KV transfer's network transport (TCP, RDMA verbs)
  iproute2                # ss: an end-to-end test reads the server's listen backlog
)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Optional (`scripts/setup.sh --fuzz`): clang 16 and its libFuzzer runtime for tests/fuzz. clang 14
# cannot compile std::source_location against this libstdc++; CI does not fuzz, so it skips this.
if [ "${1:-}" = "--fuzz" ]; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y -qq --no-install-recommends clang-16 libclang-rt-16-dev
fi

# Python packages for the test oracles and the end-to-end tests (pinned).
python3 -m pip install -q --disable-pip-version-check -r scripts/requirements-test.txt
# CUTLASS/CuTe headers for the CUDA build's grouped GEMM (cutlass_library/source/include). The wheel
# declares Python dependencies only its Python generator needs; the headers need none.
python3 -m pip install -q --disable-pip-version-check --no-deps nvidia-cutlass==4.2.0.0

# The embedded default model ships compressed; unpack it once.
bash scripts/unpack-models.sh

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
  libcpp-httplib-dev      # HTTP client (the disaggregated router and workers)
  libboost1.81-dev        # Boost.Asio/Beast (headers only): the HTTP server's event loop
  libcli11-dev            # command line
  libssl-dev zlib1g-dev   # TLS (the HTTP server, and cpp-httplib's client)
  openssl                 # the TLS tests make a throwaway CA and certificates with its CLI
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
# lm-eval for tests/python/test_lm_eval.py (its local-completions model against the server). Its
# declared dependencies (datasets, evaluate, scikit-learn, ...) serve its task harness; the API
# model needs only requests, aiohttp, tenacity and tqdm (pinned in requirements-test.txt).
python3 -m pip install -q --disable-pip-version-check --no-deps lm-eval==0.4.13

# xgrammar (Apache-2.0): the grammar engine behind structured outputs (src/grammar). Its PyPI wheel
# has no C++ API, so the static library and headers are built from the pinned PyPI source
# distribution into the ignored .deps/ folder, where CMake finds them (RELAY_XGRAMMAR_PREFIX).
# Skipped when the install exists; it is moved into place only once complete, so an interrupted run
# leaves nothing that would be mistaken for one.
XGRAMMAR_VERSION=0.2.9
XGRAMMAR_SHA256=87b466bca2475e29bb0323abc62c6c33cbcbcff47e5fb800a3e2099ac9620b90
XGRAMMAR_URL=https://files.pythonhosted.org/packages/3a/2f/5bf8e8fa6619cff534932f79b0abc81a417d354bc5093252c1a6081d0a93/xgrammar-$XGRAMMAR_VERSION.tar.gz
XGRAMMAR_PREFIX="$PWD/.deps/xgrammar-$XGRAMMAR_VERSION"
if [ ! -f "$XGRAMMAR_PREFIX/lib/libxgrammar.a" ]; then
  xgrammar_work="$(mktemp -d)"
  trap 'rm -rf "$xgrammar_work"' EXIT
  # Python's urllib rather than `pip download`, which would build the sdist's metadata (a cmake run).
  python3 -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' \
    "$XGRAMMAR_URL" "$xgrammar_work/xgrammar.tar.gz"
  echo "$XGRAMMAR_SHA256  $xgrammar_work/xgrammar.tar.gz" | sha256sum --quiet -c -
  tar -xzf "$xgrammar_work/xgrammar.tar.gz" -C "$xgrammar_work"
  mkdir "$xgrammar_work/build"
  # NOTE: the sdist's cmake/config.cmake sets XGRAMMAR_BUILD_PYTHON_BINDINGS ON as a plain variable,
  # which shadows -DXGRAMMAR_BUILD_PYTHON_BINDINGS=OFF (and the bindings need tvm_ffi); its
  # CMakeLists reads a config.cmake in the build directory first, so the options are set there.
  cat > "$xgrammar_work/build/config.cmake" <<'EOF'
set(XGRAMMAR_BUILD_PYTHON_BINDINGS OFF)
set(XGRAMMAR_BUILD_CXX_TESTS OFF)
set(XGRAMMAR_ENABLE_CPPTRACE OFF)
set(XGRAMMAR_ENABLE_COVERAGE OFF)
set(XGRAMMAR_ENABLE_INTERNAL_CHECK OFF)
EOF
  # Its CMakeLists puts "-Werror -flto=auto" before CMAKE_CXX_FLAGS; the flags given here come last
  # and win. -fno-lto: with GCC's default slim LTO objects the archive would hold only GIMPLE, so
  # every Relay binary's link would recompile xgrammar (slow on 2 cores) and need the very same GCC
  # and an LTO-aware `ar`. -Wno-error: a new warning in a newer compiler must not fail setup over
  # code that is not ours (g++ 12 builds 0.2.9 without warnings today).
  cmake -S "$xgrammar_work/xgrammar-$XGRAMMAR_VERSION" -B "$xgrammar_work/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS="-fno-lto -Wno-error" \
    -DCMAKE_INSTALL_PREFIX="$XGRAMMAR_PREFIX.partial" -DCMAKE_INSTALL_LIBDIR=lib > /dev/null
  cmake --build "$xgrammar_work/build" --target xgrammar -j "$(nproc)"
  rm -rf "$XGRAMMAR_PREFIX.partial"
  cmake --install "$xgrammar_work/build" > /dev/null
  rm -rf "$XGRAMMAR_PREFIX"
  mv "$XGRAMMAR_PREFIX.partial" "$XGRAMMAR_PREFIX"
  rm -rf "$xgrammar_work"
  trap - EXIT
fi

# The embedded default model ships compressed; unpack it once.
bash scripts/unpack-models.sh

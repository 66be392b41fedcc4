#!/usr/bin/env bash
# The whole test suite on the CPU backend: builds, runs the unit tests (CTest/GoogleTest), then the
# end-to-end tests (pytest against the built `relay` binary). This is what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc)" -LE gpu  # GPU tests: scripts/gpu-check.sh
python3 -m pytest -q tests/python

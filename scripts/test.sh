#!/usr/bin/env bash
# Fresh Debian machine -> full test suite: installs what is missing, builds everything with
# warnings as errors, runs every test (GPU tests report as skipped without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
# The library, examples and benchmarks at -O3; the test programs' own code at -O1.
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DWEAVE_WERROR=ON -DWEAVE_BUILD_TESTS=ON \
  -DWEAVE_BUILD_EXAMPLES=ON -DWEAVE_BUILD_BENCH=ON -DWEAVE_TEST_COMPILE_OPTIONS=-O1
cmake --build build -j"$(nproc)"
ctest --test-dir build --output-on-failure -j"$(nproc)"

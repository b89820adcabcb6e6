#!/usr/bin/env bash
# Fresh Debian machine -> trained model: installs what is missing, builds, trains the
# Fashion-MNIST MLP (extra arguments go to the example, e.g. --epochs 3).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DWEAVE_BUILD_TESTS=OFF -DWEAVE_BUILD_BENCH=OFF
cmake --build build -j"$(nproc)" --target fashion_mnist_mlp
./build/examples/fashion_mnist_mlp "$@"

#!/usr/bin/env bash
# Fresh Debian machine -> trained model: installs what is missing, builds, and trains the
# Fashion-MNIST MLP data-parallel on 2 local ranks under mpirun (extra arguments go to the
# example, e.g. --epochs 3; RANKS=4 for more ranks).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DWEAVE_BUILD_TESTS=OFF -DWEAVE_BUILD_BENCH=OFF
cmake --build build -j"$(nproc)" --target fashion_mnist_mlp
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
mpirun --oversubscribe --bind-to none -np "${RANKS:-2}" ./build/examples/fashion_mnist_mlp "$@"

// Trains an MLP (784-512-256-10) on Fashion-MNIST, in one process or data-parallel under
// mpirun, where DistributedDataParallel averages gradients while backward runs:
//   fashion_mnist_mlp [--epochs 10] [--batch-size 128] [--lr 0.001] [--seed 0] [--data DIR]
//                     [--threads N] [--compress bf16|fp16]
//   mpirun -np 2 fashion_mnist_mlp ...      # each rank trains on its share of every batch
// fashion_mnist_ddp takes the same flags and chooses the data-parallel strategy.
#include "fashion_mnist.h"

int main(int argc, char** argv) try {
  return fashion_mnist::run(fashion_mnist::parse(argc, argv, "fashion_mnist_mlp"));
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}

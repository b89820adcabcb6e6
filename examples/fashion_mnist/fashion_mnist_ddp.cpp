// Fashion-MNIST with a choice of data-parallel strategy, under mpirun:
//   mpirun -np 4 fashion_mnist_ddp --strategy ddp|dist-opt [--compress bf16|fp16] [...]
// ddp: DistributedDataParallel (bucketed averaging overlapped with backward); dist-opt:
// DistributedOptimizer (fused averaging before each step). Same flags, progress lines and
// closing `test_accuracy=0.XXXX` line as fashion_mnist_mlp.
#include "fashion_mnist.h"

int main(int argc, char** argv) try {
  return fashion_mnist::run(fashion_mnist::parse(argc, argv, "fashion_mnist_ddp"));
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}

// Fashion-MNIST with the MLP's big layers split across every rank (tensor parallelism):
//   mpirun -np 2 tensor_parallel_mlp [--epochs 10] [...]   (the flags of fashion_mnist_mlp)
#include "model_parallel.h"

int main(int argc, char** argv) try {
  const auto flags = fashion_mnist::parse(argc, argv, "tensor_parallel_mlp");
  return fashion_mnist::run_tensor_parallel(flags, flags.tensor);
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}

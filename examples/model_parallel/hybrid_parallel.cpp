// Fashion-MNIST on a data x tensor mesh: tensor-parallel groups of --tensor ranks (default 2),
// data parallel (DDP) across them:
//   mpirun -np 4 hybrid_parallel [--tensor 2] [--epochs 10] [...]   (a 2 x 2 mesh)
#include "model_parallel.h"

int main(int argc, char** argv) try {
  const auto flags = fashion_mnist::parse(argc, argv, "hybrid_parallel");
  return fashion_mnist::run_tensor_parallel(flags, flags.tensor > 0 ? flags.tensor : 2);
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}

// Fashion-MNIST with the MLP cut into one pipeline stage per rank:
//   mpirun -np 2 pipeline_mlp [--schedule gpipe|1f1b] [--microbatches 4] [--epochs 10] [...]
#include "model_parallel.h"

int main(int argc, char** argv) try {
  return fashion_mnist::run_pipeline(fashion_mnist::parse(argc, argv, "pipeline_mlp"));
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}

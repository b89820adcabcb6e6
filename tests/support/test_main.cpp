// doctest runner. `--require-cuda` exits 77 (CTest's skip code) when no CUDA device exists.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "weave/tensor/cuda/device_runtime.h"

int main(int argc, char** argv) {
  std::vector<char*> args;
  bool require_cuda = false;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--require-cuda") == 0)
      require_cuda = true;
    else
      args.push_back(argv[i]);
  }
  if (require_cuda && !weave::cuda::is_available()) {
    std::printf("skipped: no CUDA device (or weave built without CUDA)\n");
    return 77;
  }
  doctest::Context context(static_cast<int>(args.size()), args.data());
  return context.run();
}

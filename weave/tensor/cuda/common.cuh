#pragma once
// Shared pieces of the CUDA backend: error checks, the current-device guard, weave's stream.
#include <cuda_runtime.h>

#include "weave/tensor/error.h"
#include "weave/tensor/tensor.h"

#define WEAVE_CUDA_CHECK(expr, op)                                           \
  do {                                                                       \
    cudaError_t status_ = (expr);                                            \
    if (status_ != cudaSuccess)                                              \
      WEAVE_FAIL(op, "CUDA error {}: {} (in {})", static_cast<int>(status_), \
                 cudaGetErrorString(status_), #expr);                        \
  } while (0)

namespace weave::cuda {

/// Makes `device` current for its lifetime.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    WEAVE_CUDA_CHECK(cudaGetDevice(&previous_), "cuda");
    if (device != previous_) WEAVE_CUDA_CHECK(cudaSetDevice(device), "cuda");
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

/// The stream every weave kernel on `device` runs on (created on first use).
cudaStream_t stream(int device);

/// Checks the last launch.
inline void check_launch(const char* op) {
  WEAVE_CUDA_CHECK(cudaGetLastError(), op);
}

inline unsigned blocks_for(int64_t n, int threads) {
  return static_cast<unsigned>(std::max<int64_t>(1, (n + threads - 1) / threads));
}

}  // namespace weave::cuda

namespace weave::kernels::cuda {
using weave::cuda::blocks_for;
using weave::cuda::check_launch;
using weave::cuda::DeviceGuard;
/// Threads per block for weave's kernels.
inline constexpr int kThreads = 256;
}  // namespace weave::kernels::cuda

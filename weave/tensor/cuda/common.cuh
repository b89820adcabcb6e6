#pragma once
// Shared pieces of the CUDA kernels: weave's stream per device and launch helpers (error checks
// and the device guard: calls.h).
#include <cuda_runtime.h>

#include "weave/tensor/cuda/calls.h"

#include "weave/tensor/error.h"
#include "weave/tensor/tensor.h"

namespace weave::cuda {

/// The stream every weave kernel on `device` runs on (created on first use).
cudaStream_t stream(int device);

/// The device's properties (multiprocessors, compute capability, ...), read once per device.
const cudaDeviceProp& device_properties(int device);

/// Checks the last launch.
inline void check_launch(const char* op) {
  WEAVE_CHECK_CALL(cudaGetLastError(), op);
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
/// Blocks of kThreads for a grid-stride loop over n elements: one per kThreads, capped where
/// more would only queue (the loop covers the rest).
inline unsigned grid_stride_blocks(int64_t n) {
  return std::min<unsigned>(blocks_for(n, kThreads), 65535u * 8);
}
}  // namespace weave::kernels::cuda

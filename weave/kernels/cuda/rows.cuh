#pragma once
// What the row kernels (nn.cu, layer_norm.cu) share: sums and maxima across a warp and a block,
// one-block-per-row launches, and optional tensors as raw pointers.
#include <cuda_runtime.h>

#include "weave/tensor/cuda/common.cuh"

namespace weave::kernels::cuda {

enum class Combine { Sum, Max };

template <class T>
__device__ inline T combine(T a, T b, Combine how) {
  return how == Combine::Sum ? a + b : (b > a || b != b ? b : a);  // a NaN wins the max
}

/// Combines one value per lane across the warp (a butterfly: every lane gets the same result,
/// since each pairing is symmetric).
template <class T>
__device__ T warp_reduce(T value, Combine how) {
  for (int step = 16; step > 0; step /= 2)
    value = combine(value, __shfl_xor_sync(0xffffffffu, value, step), how);
  return value;
}

/// Combines one value per thread across the block; every thread gets the result. The warps
/// reduce by shuffles, then every thread folds the warps' results in order.
template <class T>
__device__ T block_reduce(T value, Combine how) {
  __shared__ T warps[32];
  value = warp_reduce(value, how);
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = value;
  __syncthreads();
  T result = warps[0];
  for (int w = 1; w < int(blockDim.x / 32); ++w) result = combine(result, warps[w], how);
  __syncthreads();  // warps is reused by the next call
  return result;
}

inline int64_t rows_of(const Tensor& t, int64_t n) {
  return n == 0 ? 0 : t.numel() / n;
}

/// Launches one block per row on t's device stream (nothing for no rows).
template <class Launch>
void per_row(const Tensor& t, int64_t rows, const char* op, const Launch& launch) {
  if (rows == 0) return;
  WEAVE_CHECK(rows <= 0x7fffffff, op, "too many rows ({}) for one launch", rows);
  DeviceGuard guard(t.device().index);
  launch(static_cast<unsigned>(rows), weave::cuda::stream(t.device().index));
  check_launch(op);
}

template <class T>
const T* maybe(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.data_ptr()) : nullptr;
}
template <class T>
T* maybe_mut(const Tensor& t) {
  return t.defined() ? static_cast<T*>(t.data_ptr()) : nullptr;
}

}  // namespace weave::kernels::cuda

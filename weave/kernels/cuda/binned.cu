// Reproducible sums on CUDA: the element functions of common/binned.h, the same bits as the
// CPU's. Exact power sums add 32-bit digits into int64 limbs with atomics, first per block in
// shared memory, then once per block into the result: integer additions in any order agree.
#include <vector>

#include "weave/kernels/backends.h"
#include "weave/kernels/common/binned.h"
#include "weave/tensor/cuda/common.cuh"

namespace weave::kernels::cuda {

namespace {

template <class T>
__global__ void binned_add_kernel(const T* x, uint8_t* window, int64_t* limbs, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    common::binned_add_element(window[i], limbs[2 * i], limbs[2 * i + 1],
                               double(compute_t<T>(x[i])));
}

__global__ void binned_raise_kernel(uint8_t* window, int64_t* limbs, const uint8_t* to, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    if (to[i] != common::kNotFinite)
      common::raise_window(limbs[2 * i], limbs[2 * i + 1], window[i], to[i]);
    window[i] = to[i];
  }
}

template <class T>
__global__ void binned_value_kernel(const uint8_t* window, const int64_t* limbs, double divisor,
                                    T* out, int64_t n) {
  using C = compute_t<T>;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] =
        T(C(common::binned_element_value(window[i], limbs[2 * i], limbs[2 * i + 1]) / divisor));
}

__device__ void atomic_add(int64_t* at, int64_t value) {
  atomicAdd(reinterpret_cast<unsigned long long*>(at), static_cast<unsigned long long>(value));
}

// Each thread adds its elements' digits into the block's limbs; the block normalizes them and
// adds them to the total (so the total's limbs stay far from overflowing).
template <class T>
__global__ void exact_power_sum_kernel(const T* x, int64_t n, double p, int64_t* total) {
  __shared__ int64_t limbs[common::kExactLimbs];
  __shared__ int not_finite;
  for (int k = threadIdx.x; k < common::kExactLimbs; k += blockDim.x) limbs[k] = 0;
  if (threadIdx.x == 0) not_finite = 0;
  __syncthreads();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const double v = fabs(double(compute_t<T>(x[i])));
    const double power = p == 2 ? v * v : p == 1 ? v : pow(v, p);
    if (!isfinite(power)) {
      not_finite = 1;
      continue;
    }
    int k;
    int64_t digits[3];
    if (!common::exact_digits(power, k, digits)) continue;
    for (int d = 0; d < 3; ++d) atomic_add(&limbs[k + d], digits[d]);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    common::exact_normalize(limbs);
    for (int k = 0; k < common::kExactLimbs; ++k)
      if (limbs[k] != 0) atomic_add(&total[k], limbs[k]);
    if (not_finite) atomic_add(&total[common::kExactLimbs], 1);
  }
}

__global__ void exact_normalize_kernel(int64_t* total) {
  common::exact_normalize(total);
}

}  // namespace

void binned_add(const Tensor& x, const Tensor& window, const Tensor& limbs) {
  DeviceGuard guard(window.device().index);
  const int64_t n = x.numel();
  if (n == 0) return;
  visit_param_dtype(x.dtype(), "binned_add", [&](auto tag) {
    using T = typename decltype(tag)::type;
    binned_add_kernel<T>
        <<<grid_stride_blocks(n), kThreads, 0, weave::cuda::stream(window.device().index)>>>(
            x.data<T>(), window.data<uint8_t>(), limbs.data<int64_t>(), n);
  });
  check_launch("binned_add");
}

void binned_raise(const Tensor& window, const Tensor& limbs, const Tensor& to) {
  DeviceGuard guard(window.device().index);
  const int64_t n = window.numel();
  if (n == 0) return;
  binned_raise_kernel<<<grid_stride_blocks(n), kThreads, 0,
                        weave::cuda::stream(window.device().index)>>>(
      window.data<uint8_t>(), limbs.data<int64_t>(), to.data<uint8_t>(), n);
  check_launch("binned_raise");
}

void binned_value(const Tensor& window, const Tensor& limbs, double divisor, const Tensor& out) {
  DeviceGuard guard(out.device().index);
  const int64_t n = out.numel();
  if (n == 0) return;
  visit_param_dtype(out.dtype(), "binned_value", [&](auto tag) {
    using T = typename decltype(tag)::type;
    binned_value_kernel<T>
        <<<grid_stride_blocks(n), kThreads, 0, weave::cuda::stream(out.device().index)>>>(
            window.data<uint8_t>(), limbs.data<int64_t>(), divisor, out.data<T>(), n);
  });
  check_launch("binned_value");
}

void exact_power_sum(const std::vector<Tensor>& xs, double p, const Tensor& limbs) {
  DeviceGuard guard(limbs.device().index);
  cudaStream_t stream = weave::cuda::stream(limbs.device().index);
  for (const Tensor& x : xs) {
    const int64_t n = x.numel();
    if (n == 0) continue;
    visit_param_dtype(x.dtype(), "exact_power_sum", [&](auto tag) {
      using T = typename decltype(tag)::type;
      exact_power_sum_kernel<T>
          <<<std::min<unsigned>(grid_stride_blocks(n), 1024u), kThreads, 0, stream>>>(
              x.data<T>(), n, p, limbs.data<int64_t>());
    });
    check_launch("exact_power_sum");
  }
  exact_normalize_kernel<<<1, 1, 0, stream>>>(limbs.data<int64_t>());
  check_launch("exact_power_sum");
}

}  // namespace weave::kernels::cuda

// Fused optimizer updates on CUDA: one grid-stride pass over the parameter and its state.
#include "weave/kernels/backends.h"
#include "weave/kernels/common/optim.h"
#include "weave/tensor/cuda/common.cuh"

namespace weave::kernels::cuda {

namespace {

// P: the parameter's and gradient's type; the state and the arithmetic are in T = compute_t<P>.
template <class P, class T = compute_t<P>>
__global__ void adam_kernel(P* p, const P* g, T* m, T* v, int64_t n, functors::AdamConstants<T> c) {
  const int64_t stride = int64_t(blockDim.x) * gridDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    T value = T(p[i]);
    functors::adam_element(value, T(g[i]), m[i], v[i], c);
    p[i] = P(value);
  }
}

template <class P, class T = compute_t<P>>
__global__ void sgd_kernel(P* p, const P* g, T* buffer, int64_t n, functors::SgdConstants<T> c) {
  const int64_t stride = int64_t(blockDim.x) * gridDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    T value = T(p[i]), unused = 0;
    functors::sgd_element(value, T(g[i]), buffer ? buffer[i] : unused, c);
    p[i] = P(value);
  }
}

}  // namespace

void sgd_update(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer,
                const SgdStep& step) {
  DeviceGuard guard(param.device().index);
  const int64_t n = param.numel();
  if (n == 0) return;
  const unsigned blocks = grid_stride_blocks(n);
  auto launch = [&](auto tag) {
    using P = typename decltype(tag)::type;
    using T = compute_t<P>;
    const auto c = common::sgd_constants<T>(step);
    sgd_kernel<P><<<blocks, kThreads, 0, weave::cuda::stream(param.device().index)>>>(
        static_cast<P*>(param.data_ptr()), static_cast<const P*>(grad.data_ptr()),
        step.momentum != 0 ? static_cast<T*>(momentum_buffer.data_ptr()) : nullptr, n, c);
  };
  visit_param_dtype(param.dtype(), "sgd_update", launch);
  check_launch("sgd_update");
}

void adam_update(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                 const Tensor& exp_avg_sq, const AdamStep& step) {
  DeviceGuard guard(param.device().index);
  const int64_t n = param.numel();
  if (n == 0) return;
  const unsigned blocks = grid_stride_blocks(n);
  auto launch = [&](auto tag) {
    using P = typename decltype(tag)::type;
    using T = compute_t<P>;
    const auto c = common::adam_constants<T>(step);
    adam_kernel<P><<<blocks, kThreads, 0, weave::cuda::stream(param.device().index)>>>(
        static_cast<P*>(param.data_ptr()), static_cast<const P*>(grad.data_ptr()),
        static_cast<T*>(exp_avg.data_ptr()), static_cast<T*>(exp_avg_sq.data_ptr()), n, c);
  };
  visit_param_dtype(param.dtype(), "adam_update", launch);
  check_launch("adam_update");
}

}  // namespace weave::kernels::cuda

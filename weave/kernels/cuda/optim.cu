// Fused optimizer updates on CUDA: one grid-stride pass over the parameter and its state.
#include "weave/kernels/backends.h"
#include "weave/tensor/cuda/common.cuh"

namespace weave::kernels::cuda {

namespace {

template <class T>
__global__ void adam_kernel(T* p, const T* g, T* m, T* v, int64_t n, fn::AdamConstants<T> c) {
  const int64_t stride = int64_t(blockDim.x) * gridDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    fn::adam_element(p[i], g[i], m[i], v[i], c);
}

template <class T>
__global__ void sgd_kernel(T* p, const T* g, T* buffer, int64_t n, fn::SgdConstants<T> c) {
  const int64_t stride = int64_t(blockDim.x) * gridDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    T unused = 0;
    fn::sgd_element(p[i], g[i], buffer ? buffer[i] : unused, c);
  }
}

}  // namespace

void sgd_update(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer,
                const SgdStep& step) {
  DeviceGuard guard(param.device().index);
  const int64_t n = param.numel();
  if (n == 0) return;
  const unsigned blocks = std::min<unsigned>(blocks_for(n, kThreads), 65535u * 8);
  auto launch = [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto c = fn::sgd_constants<T>(step.lr, step.momentum, step.dampening, step.weight_decay,
                                        step.nesterov, step.first);
    sgd_kernel<T><<<blocks, kThreads, 0, weave::cuda::stream(param.device().index)>>>(
        static_cast<T*>(param.data_ptr()), static_cast<const T*>(grad.data_ptr()),
        step.momentum != 0 ? static_cast<T*>(momentum_buffer.data_ptr()) : nullptr, n, c);
  };
  visit_floating(param.dtype(), "sgd_update", launch);
  check_launch("sgd_update");
}

void adam_update(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                 const Tensor& exp_avg_sq, const AdamStep& step) {
  DeviceGuard guard(param.device().index);
  const int64_t n = param.numel();
  if (n == 0) return;
  const unsigned blocks = std::min<unsigned>(blocks_for(n, kThreads), 65535u * 8);
  auto launch = [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto c =
        fn::adam_constants<T>(step.lr, step.beta1, step.beta2, step.eps, step.weight_decay,
                              step.correction1, step.correction2, step.decoupled);
    adam_kernel<T><<<blocks, kThreads, 0, weave::cuda::stream(param.device().index)>>>(
        static_cast<T*>(param.data_ptr()), static_cast<const T*>(grad.data_ptr()),
        static_cast<T*>(exp_avg.data_ptr()), static_cast<T*>(exp_avg_sq.data_ptr()), n, c);
  };
  visit_floating(param.dtype(), "adam_update", launch);
  check_launch("adam_update");
}

}  // namespace weave::kernels::cuda

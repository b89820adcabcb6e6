// Fused optimizer updates on the CPU: one pass over the parameter and its state.
#include "weave/kernels/backends.h"
#include "weave/kernels/cpu/loops.h"

namespace weave::kernels::cpu {

namespace {

// One contiguous range, with everything in registers: restrict pointers and constants by
// value, so the loop vectorizes (sqrt and divide included).
template <class T>
void adam_range(T* __restrict p, const T* __restrict g, T* __restrict m, T* __restrict v, int64_t n,
                const fn::AdamConstants<T> c) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) fn::adam_element(p[i], g[i], m[i], v[i], c);
}

template <class T>
void sgd_range(T* __restrict p, const T* __restrict g, T* __restrict buffer, int64_t n,
               const fn::SgdConstants<T> c) {
  if (buffer == nullptr) {  // no momentum
    T unused = 0;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      T local = unused;
      fn::sgd_element(p[i], g[i], local, c);
    }
    return;
  }
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) fn::sgd_element(p[i], g[i], buffer[i], c);
}

}  // namespace

void sgd_update(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer,
                const SgdStep& step) {
  auto run = [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto c = fn::sgd_constants<T>(step.lr, step.momentum, step.dampening, step.weight_decay,
                                        step.nesterov, step.first);
    T* p = param.data<T>();
    const T* g = grad.data<T>();
    T* buffer = step.momentum != 0 ? momentum_buffer.data<T>() : nullptr;
    for_ranges(param.numel(), [&](int64_t begin, int64_t count) {
      sgd_range(p + begin, g + begin, buffer ? buffer + begin : nullptr, count, c);
    });
  };
  visit_floating(param.dtype(), "sgd_update", run);
}

void adam_update(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                 const Tensor& exp_avg_sq, const AdamStep& step) {
  auto run = [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto c =
        fn::adam_constants<T>(step.lr, step.beta1, step.beta2, step.eps, step.weight_decay,
                              step.correction1, step.correction2, step.decoupled);
    T* p = param.data<T>();
    const T* g = grad.data<T>();
    T* m = exp_avg.data<T>();
    T* v = exp_avg_sq.data<T>();
    for_ranges(param.numel(), [&](int64_t begin, int64_t count) {
      adam_range(p + begin, g + begin, m + begin, v + begin, count, c);
    });
  };
  visit_floating(param.dtype(), "adam_update", run);
}

}  // namespace weave::kernels::cpu

// Fused optimizer updates on the CPU: one pass over the parameter and its state.
#include "weave/kernels/backends.h"
#include "weave/kernels/cpu/loops.h"

namespace weave::kernels::cpu {

namespace {

// One contiguous range, with everything in registers: restrict pointers and constants by
// value, so the loop vectorizes (sqrt and divide included).
// P: the parameter's and gradient's type; the state and the arithmetic are in T = compute_t<P>.
template <class P, class T = compute_t<P>>
void adam_range(P* __restrict p, const P* __restrict g, T* __restrict m, T* __restrict v, int64_t n,
                const functors::AdamConstants<T> c) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    T value = T(p[i]);
    functors::adam_element(value, T(g[i]), m[i], v[i], c);
    p[i] = P(value);
  }
}

template <class P, class T = compute_t<P>>
void sgd_range(P* __restrict p, const P* __restrict g, T* __restrict buffer, int64_t n,
               const functors::SgdConstants<T> c) {
  if (buffer == nullptr) {  // no momentum
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      T value = T(p[i]), local = 0;
      functors::sgd_element(value, T(g[i]), local, c);
      p[i] = P(value);
    }
    return;
  }
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    T value = T(p[i]);
    functors::sgd_element(value, T(g[i]), buffer[i], c);
    p[i] = P(value);
  }
}

}  // namespace

void sgd_update(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer,
                const SgdStep& step) {
  auto run = [&](auto tag) {
    using P = typename decltype(tag)::type;
    using T = compute_t<P>;
    const auto c = functors::sgd_constants<T>(step.lr, step.momentum, step.dampening,
                                              step.weight_decay, step.nesterov, step.first);
    P* p = param.data<P>();
    const P* g = grad.data<P>();
    T* buffer = step.momentum != 0 ? momentum_buffer.data<T>() : nullptr;
    for_ranges(param.numel(), [&](int64_t begin, int64_t count) {
      sgd_range(p + begin, g + begin, buffer ? buffer + begin : nullptr, count, c);
    });
  };
  visit_param_dtype(param.dtype(), "sgd_update", run);
}

void adam_update(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                 const Tensor& exp_avg_sq, const AdamStep& step) {
  auto run = [&](auto tag) {
    using P = typename decltype(tag)::type;
    using T = compute_t<P>;
    const auto c =
        functors::adam_constants<T>(step.lr, step.beta1, step.beta2, step.eps, step.weight_decay,
                                    step.correction1, step.correction2, step.decoupled);
    P* p = param.data<P>();
    const P* g = grad.data<P>();
    T* m = exp_avg.data<T>();
    T* v = exp_avg_sq.data<T>();
    for_ranges(param.numel(), [&](int64_t begin, int64_t count) {
      adam_range(p + begin, g + begin, m + begin, v + begin, count, c);
    });
  };
  visit_param_dtype(param.dtype(), "adam_update", run);
}

}  // namespace weave::kernels::cpu

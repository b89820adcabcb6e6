// Fused optimizer updates on the CPU: one pass over the parameter and its state.
#include <omp.h>

#include "weave/kernels/backends.h"
#include "weave/kernels/cpu/loops.h"

namespace weave::kernels::cpu {

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
    const int64_t n = param.numel();
#pragma omp parallel for simd if (n >= kParallelGrain && omp_get_max_threads() > 1)
    for (int64_t i = 0; i < n; ++i) fn::adam_element(p[i], g[i], m[i], v[i], c);
  };
  if (param.dtype() == kFloat32)
    run(type_tag<float>{});
  else if (param.dtype() == kFloat64)
    run(type_tag<double>{});
  else
    WEAVE_FAIL("adam_update", "expected float32 or float64, found {}", param.dtype());
}

}  // namespace weave::kernels::cpu

// Fused optimizer updates on the CPU: one pass over the parameter and its state; the norm and
// scaling of many gradients at once (clipping).
#include <cmath>

#include "weave/kernels/backends.h"
#include "weave/kernels/common/optim.h"
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
    const auto c = common::sgd_constants<T>(step);
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
    const auto c = common::adam_constants<T>(step);
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

void adam_update_many(const std::vector<AdamTensors>& tensors, const AdamStep& step) {
  AdamStep now = step;
  if (step.scalars != nullptr) {
    now.lr = step.scalars[0];
    now.correction1 = step.scalars[1];
    now.correction2 = step.scalars[2];
  }
  for (const AdamTensors& t : tensors) {
    AdamStep own = now;
    own.weight_decay = t.weight_decay;
    cpu::adam_update(t.param, t.grad, t.exp_avg, t.exp_avg_sq, own);
  }
}

void norm_power_sum(const std::vector<Tensor>& xs, double p, const Tensor& out) {
  const bool largest = std::isinf(p);
  double total = 0;
  for (const Tensor& x : xs) {
    visit_param_dtype(x.dtype(), "norm_power_sum", [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T* data = x.data<T>();
      const int64_t n = x.numel();
      double acc = 0;
      if (largest) {
        for (int64_t i = 0; i < n; ++i) {
          const double v = std::abs(double(compute_t<T>(data[i])));
          acc = (std::isnan(acc) || std::isnan(v)) ? NAN : std::max(acc, v);
        }
        total = (std::isnan(total) || std::isnan(acc)) ? NAN : std::max(total, acc);
      } else if (p == 2) {
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < n; ++i) {
          const double v = double(compute_t<T>(data[i]));
          acc += v * v;
        }
        total += acc;
      } else {
        for (int64_t i = 0; i < n; ++i) acc += std::pow(std::abs(double(compute_t<T>(data[i]))), p);
        total += acc;
      }
    });
  }
  *out.data<double>() = total;
}

void scale_many(const std::vector<Tensor>& xs, double scale) {
  for (const Tensor& x : xs) {
    visit_param_dtype(x.dtype(), "scale_many", [&](auto tag) {
      using T = typename decltype(tag)::type;
      using C = compute_t<T>;
      T* data = x.data<T>();
      const C s = C(scale);
      for_ranges(x.numel(), [&](int64_t begin, int64_t count) {
        for (int64_t i = begin; i < begin + count; ++i) data[i] = T(C(data[i]) * s);
      });
    });
  }
}

void clip_many(const std::vector<Tensor>& xs, const Tensor& power_sum, double p, double max_norm,
               const Tensor& norm) {
  const double sum = *power_sum.data<double>();
  const double total = std::isinf(p) ? sum : std::pow(sum, 1.0 / p);
  const double scale = max_norm / (total + 1e-6);
  const double coefficient = scale >= 1 ? 1.0 : scale;  // NaN scales by NaN, as on the host
  norm.data<double>()[0] = total;
  norm.data<double>()[1] = coefficient;
  scale_many(xs, coefficient);
}

void adam_advance(const Tensor& scalars, double beta1, double beta2) {
  double* s = scalars.data<double>();
  s[0] += 1;
  s[2] = 1 - std::pow(beta1, s[0]);
  s[3] = 1 - std::pow(beta2, s[0]);
}

}  // namespace weave::kernels::cpu

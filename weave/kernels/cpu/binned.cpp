// Reproducible sums on the CPU: the element functions of common/binned.h over whole tensors.
// Integer limbs add associatively, so the threads' split of the work changes no bit.
#include <cmath>
#include <vector>

#include "weave/kernels/backends.h"
#include "weave/kernels/common/binned.h"
#include "weave/kernels/cpu/loops.h"

namespace weave::kernels::cpu {

void binned_add(const Tensor& x, const Tensor& window, const Tensor& limbs) {
  uint8_t* w = window.data<uint8_t>();
  int64_t* l = limbs.data<int64_t>();
  visit_param_dtype(x.dtype(), "binned_add", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* data = x.data<T>();
    for_ranges(x.numel(), [&](int64_t begin, int64_t count) {
      for (int64_t i = begin; i < begin + count; ++i)
        common::binned_add_element(w[i], l[2 * i], l[2 * i + 1], double(compute_t<T>(data[i])));
    });
  });
}

void binned_raise(const Tensor& window, const Tensor& limbs, const Tensor& to) {
  uint8_t* w = window.data<uint8_t>();
  int64_t* l = limbs.data<int64_t>();
  const uint8_t* target = to.data<uint8_t>();
  for_ranges(window.numel(), [&](int64_t begin, int64_t count) {
    for (int64_t i = begin; i < begin + count; ++i) {
      if (target[i] != common::kNotFinite)
        common::raise_window(l[2 * i], l[2 * i + 1], w[i], target[i]);
      w[i] = target[i];
    }
  });
}

void binned_value(const Tensor& window, const Tensor& limbs, double divisor, const Tensor& out) {
  const uint8_t* w = window.data<uint8_t>();
  const int64_t* l = limbs.data<int64_t>();
  visit_param_dtype(out.dtype(), "binned_value", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = compute_t<T>;
    T* data = out.data<T>();
    for_ranges(out.numel(), [&](int64_t begin, int64_t count) {
      for (int64_t i = begin; i < begin + count; ++i)
        data[i] = T(C(common::binned_element_value(w[i], l[2 * i], l[2 * i + 1]) / divisor));
    });
  });
}

void exact_power_sum(const std::vector<Tensor>& xs, double p, const Tensor& limbs) {
  int64_t* total = limbs.data<int64_t>();
  for (const Tensor& x : xs) {
    const int64_t n = x.numel();
    const int threads = threads_for(n);
    std::vector<int64_t> parts(size_t(threads) * common::kExactLimbs, 0);
    std::vector<char> part_finite(size_t(threads), 1);
    visit_param_dtype(x.dtype(), "exact_power_sum", [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T* data = x.data<T>();
      const int64_t chunk = (n + threads - 1) / threads;
#pragma omp parallel for num_threads(threads) if (threads > 1)
      for (int t = 0; t < threads; ++t) {
        int64_t* mine = parts.data() + size_t(t) * common::kExactLimbs;
        for (int64_t i = t * chunk; i < std::min(n, (t + 1) * chunk); ++i) {
          const double v = std::abs(double(compute_t<T>(data[i])));
          const double power = p == 2 ? v * v : p == 1 ? v : std::pow(v, p);
          if (!std::isfinite(power)) part_finite[size_t(t)] = 0;
          common::exact_add(mine, power);
          if ((i + 1) % (int64_t(1) << 30) == 0) common::exact_normalize(mine);
        }
        common::exact_normalize(mine);
      }
    });
    for (int t = 0; t < threads; ++t) {
      total[common::kExactLimbs] += part_finite[size_t(t)] ? 0 : 1;
      for (int k = 0; k < common::kExactLimbs; ++k)
        total[k] += parts[size_t(t) * common::kExactLimbs + size_t(k)];
    }
    common::exact_normalize(total);
  }
}

}  // namespace weave::kernels::cpu

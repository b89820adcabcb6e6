// Rotary position embeddings on the CPU: one task per (batch, position) row, whose cosines and
// sines are formed once (in float64) and shared by all of the row's heads.
#include <omp.h>

#include <cmath>
#include <vector>

#include "weave/kernels/backends.h"
#include "weave/kernels/cpu/loops.h"

namespace weave::kernels::cpu {

void rotary(const Tensor& x, const Tensor& positions, const Tensor& frequencies, bool interleaved,
            bool inverse, const Tensor& out) {
  const int64_t batch = x.size(0), seq = x.size(1), heads = x.size(2), dim = x.size(3);
  const int64_t pairs = frequencies.numel(), rows = batch * seq;
  const double* frequency = frequencies.data<double>();
  const int64_t* position = positions.data<int64_t>();
  const int64_t ps0 = positions.strides()[0], ps1 = positions.strides()[1];
  visit_floating(x.dtype(), "rotary_embedding", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* px = x.data<T>();
    T* po = out.data<T>();
    const auto& xs = x.strides();
    const auto& os = out.strides();
    const int threads = threads_for(rows * heads * dim);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
      std::vector<T> cosines(pairs), sines(pairs);
#pragma omp for schedule(static)
      for (int64_t row = 0; row < rows; ++row) {
        const int64_t b = row / seq, t = row % seq;
        const double p = double(position[b * ps0 + t * ps1]);
        for (int64_t i = 0; i < pairs; ++i) {
          const double angle = p * frequency[i];
          cosines[i] = T(std::cos(angle));
          sines[i] = T(inverse ? -std::sin(angle) : std::sin(angle));
        }
        for (int64_t h = 0; h < heads; ++h) {
          const T* xi = px + b * xs[0] + t * xs[1] + h * xs[2];
          T* oi = po + b * os[0] + t * os[1] + h * os[2];
          for (int64_t i = 0; i < pairs; ++i) {
            const int64_t first = interleaved ? 2 * i : i,
                          second = interleaved ? 2 * i + 1 : i + pairs;
            const T a = xi[first], c = xi[second];  // read both before writing (out may be x)
            oi[first] = a * cosines[i] - c * sines[i];
            oi[second] = c * cosines[i] + a * sines[i];
          }
          if (oi != xi)
            for (int64_t j = 2 * pairs; j < dim; ++j) oi[j] = xi[j];
        }
      }
    }
  });
}

}  // namespace weave::kernels::cpu

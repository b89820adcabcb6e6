// weave add (float32, 16M elements) and the fused Adam step (10M float32 parameters) vs memcpy,
// same run. Bandwidth counts the bytes each one must move: add reads two arrays and writes one;
// Adam reads parameter, gradient and both moments and writes parameter and moments (7 arrays);
// memcpy reads one and writes one. ratio = GBps / memcpy_GBps.
#include <cstdio>
#include <cstring>
#include <vector>

#include <weave/weave.h>
#include "bench_util.h"

using namespace weave;

int main() {
  const int64_t n = int64_t{1} << 24;
  const double bytes = double(n) * sizeof(float);
  Tensor a = rand({n}), b = rand({n});
  std::vector<float> src(n, 1.0f), dst(n, 0.0f);
  Tensor out;
  // memcpy is single-threaded, so weave is measured both on one thread and on all of them.
  const int all_threads = num_threads();
  for (int threads : {1, all_threads}) {
    set_num_threads(threads);
    auto [add_s, copy_s] =
        bench::alternate([&] { out = add(a, b); },
                         [&] { std::memcpy(dst.data(), src.data(), n * sizeof(float)); }, 21);
    const double add_gbps = 3 * bytes / add_s * 1e-9, copy_gbps = 2 * bytes / copy_s * 1e-9;
    std::printf(
        "name=add_f32 elements=%ld threads=%d add_ms=%.3f memcpy_ms=%.3f add_GBps=%.2f "
        "memcpy_GBps=%.2f ratio=%.3f\n",
        long(n), threads, add_s * 1e3, copy_s * 1e3, add_gbps, copy_gbps, add_gbps / copy_gbps);
    if (all_threads == 1) break;
  }
  // The fused Adam step over one 10M-parameter tensor (after a first step creates its state).
  const int64_t params = 10'000'000;
  Tensor weight = rand({params}).requires_grad_(true);
  weight.set_grad(rand({params}));
  std::vector<float> big_src(params, 1.0f), big_dst(params, 0.0f);
  for (int threads : {1, all_threads}) {
    set_num_threads(threads);
    optim::Adam adam({weight}, {.lr = 1e-6});
    adam.step();
    auto [adam_s, copy_s] = bench::alternate(
        [&] { adam.step(); },
        [&] { std::memcpy(big_dst.data(), big_src.data(), params * sizeof(float)); }, 21);
    const double adam_gbps = 7.0 * double(params) * 4 / adam_s * 1e-9;
    const double copy_gbps = 2.0 * double(params) * 4 / copy_s * 1e-9;
    std::printf(
        "name=adam_f32 parameters=%ld threads=%d adam_ms=%.3f memcpy_ms=%.3f adam_GBps=%.2f "
        "memcpy_GBps=%.2f ratio=%.3f\n",
        long(params), threads, adam_s * 1e3, copy_s * 1e3, adam_gbps, copy_gbps,
        adam_gbps / copy_gbps);
    if (all_threads == 1) break;
  }
}

// weave add (float32, 16M elements) vs memcpy of the same bytes, same run.
// Bandwidth counts the bytes each one must move: add reads two arrays and writes one; memcpy
// reads one and writes one. ratio = add_GBps / memcpy_GBps.
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
}

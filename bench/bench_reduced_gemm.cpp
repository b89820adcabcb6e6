// bfloat16, float16 and float32 matmul in weave on squares and on the GPT example's step shapes
// (forward and backward of its default model: 2048 rows of dim 256, q/k/v 768, MLP 1024), and
// the alternative a library without a bfloat16 GEMM has: widen to float32, SGEMM, round back.
// bench/compare_reduced_gemm.sh runs this beside bench/torch_gemm.py (same shapes) and reports.
//   bench_reduced_gemm [trials=5]
// Prints `name=... m= k= n= dtype= ms= gflops=` per case (median of the trials).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <weave/weave.h>
#include "bench_util.h"

using namespace weave;

struct GemmShape {
  const char* name;
  int64_t m, k, n;
};

// The one list of shapes; bench/torch_gemm.py holds the same list.
const std::vector<GemmShape> kShapes = {
    {"square512", 512, 512, 512},     {"square1024", 1024, 1024, 1024},
    {"square2048", 2048, 2048, 2048}, {"square4096", 4096, 4096, 4096},
    {"gpt_qkv", 2048, 256, 768},      {"gpt_qkv_dx", 2048, 768, 256},
    {"gpt_qkv_dw", 768, 2048, 256},   {"gpt_fc1", 2048, 256, 1024},
    {"gpt_fc2", 2048, 1024, 256},     {"gpt_fc2_dw", 256, 2048, 1024},
    {"gpt_out_proj", 2048, 256, 256},
};

int main(int argc, char** argv) {
  const int trials = argc > 1 ? std::atoi(argv[1]) : 5;
  for (const GemmShape& s : kShapes) {
    const double flops = 2.0 * double(s.m) * double(s.k) * double(s.n);
    const int reps = flops > 1e11 ? 1 : flops > 1e10 ? 3 : 10;
    auto report = [&](const char* dtype, double seconds) {
      std::printf("name=%s m=%ld k=%ld n=%ld dtype=%s ms=%.3f gflops=%.1f\n", s.name, long(s.m),
                  long(s.k), long(s.n), dtype, seconds * 1e3 / reps, flops * reps / seconds * 1e-9);
    };
    Tensor a = randn({s.m, s.k}), b = randn({s.k, s.n});
    Tensor a16 = a.to(kBFloat16), b16 = b.to(kBFloat16);
    Tensor ah = a.to(kFloat16), bh = b.to(kFloat16);
    Tensor out;
    auto time = [&](const std::function<void()>& fn) {
      fn();  // warm-up (and oneDNN's primitive, built once per shape)
      std::vector<double> t;
      for (int i = 0; i < trials; ++i)
        t.push_back(bench::seconds([&] {
          for (int r = 0; r < reps; ++r) fn();
        }));
      return bench::median(t);
    };
    report("float32", time([&] { out = matmul(a, b); }));
    report("bfloat16", time([&] { out = matmul(a16, b16); }));
    report("float16", time([&] { out = matmul(ah, bh); }));
    report("bfloat16_widened",
           time([&] { out = matmul(a16.to(kFloat32), b16.to(kFloat32)).to(kBFloat16); }));
  }
}

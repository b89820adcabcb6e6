// bfloat16, float16 and float32 matmul in weave on squares and on the GPT example's step shapes
// (forward and backward of its default model: 2048 rows of dim 256, q/k/v 768, MLP 1024), and
// the alternative a library without a bfloat16 GEMM has: widen to float32, SGEMM, round back.
// bench/kernels/compare_reduced_gemm.sh runs this beside bench/kernels/torch_gemm.py (same shapes)
// and reports.
//   bench_reduced_gemm [trials=5]
// Prints `name=... m= k= n= dtype= ms= gflops=` per case (median of the trials).
// With `--gpt LAYERS DIM HEADS CONTEXT BATCH VOCAB`, one thread: the bfloat16 GEMMs of a GPT
// training step under autocast (bench/training/compare_gpt.sh's limit with `bf16`), the same list
// as bench_gemm's `--gpt` (bench::gpt_step_products):
//   gemm dtype=bfloat16 threads=1 gpt_step ... us=
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

// The one list of shapes; bench/kernels/torch_gemm.py holds the same list.
const std::vector<GemmShape> kShapes = {
    {"square512", 512, 512, 512},     {"square1024", 1024, 1024, 1024},
    {"square2048", 2048, 2048, 2048}, {"square4096", 4096, 4096, 4096},
    {"gpt_qkv", 2048, 256, 768},      {"gpt_qkv_dx", 2048, 768, 256},
    {"gpt_qkv_dw", 768, 2048, 256},   {"gpt_fc1", 2048, 256, 1024},
    {"gpt_fc2", 2048, 1024, 256},     {"gpt_fc2_dw", 256, 2048, 1024},
    {"gpt_out_proj", 2048, 256, 256},
};

// One product of a [m, k] (or its transpose) and b [k, n] (or its transpose) in bfloat16,
// microseconds, median of reps after a warm-up.
double product_us(bool transpose_a, bool transpose_b, int64_t m, int64_t k, int64_t n, int reps) {
  Tensor a = transpose_a ? randn({k, m}).to(kBFloat16).t() : randn({m, k}).to(kBFloat16);
  Tensor b = transpose_b ? randn({n, k}).to(kBFloat16).t() : randn({k, n}).to(kBFloat16);
  Tensor out = matmul(a, b);
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) t.push_back(bench::seconds([&] { out = matmul(a, b); }));
  return bench::median(t) * 1e6;
}

void gpt_step(int layers, int dim, int heads, int context, int batch, int vocab) {
  double linear_us = 0, attention_us = 0;
  for (const auto& p : bench::gpt_step_products(layers, dim, heads, context, batch, vocab))
    (p.attention ? attention_us : linear_us) +=
        p.times * product_us(p.transpose_a, p.transpose_b, p.m, p.k, p.n, 7);
  std::printf(
      "gemm dtype=bfloat16 threads=1 gpt_step layers=%d dim=%d heads=%d context=%d batch=%d "
      "vocab=%d linear_us=%.0f attention_us=%.0f us=%.0f\n",
      layers, dim, heads, context, batch, vocab, linear_us, attention_us, linear_us + attention_us);
}

int main(int argc, char** argv) {
  if (argc == 8 && std::string(argv[1]) == "--gpt") {
    set_num_threads(1);
    gpt_step(std::stoi(argv[2]), std::stoi(argv[3]), std::stoi(argv[4]), std::stoi(argv[5]),
             std::stoi(argv[6]), std::stoi(argv[7]));
    return 0;
  }
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

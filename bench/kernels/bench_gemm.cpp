// float32 GEMM from Eigen, OpenBLAS and BLIS on the same shapes: the eight GEMMs of the MLP
// 784-256-128-10's training step at batch 64 and 1024 (forward x W^T, the weight gradients
// dZ^T X, the input gradients dZ W) and squares of 256..2048, at 1 and 2 threads. One binary
// per library (bench_gemm_eigen, bench_gemm_openblas, bench_gemm_blis; the BLAS libraries
// export the same symbols); bench/kernels/compare_gemm.sh runs all three. Lines:
//   gemm lib=L threads=T shape=NAME m= k= n= us= gflops=      (median of repetitions)
//   gemm lib=L threads=T mlp_step batch=B us=                 (the step's eight, summed)
// With `--gpt LAYERS DIM HEADS CONTEXT BATCH VOCAB`, one thread: the GEMMs of a GPT training
// step instead (bench/training/compare_gpt.sh's limit), each linear's forward, input and weight
// gradients, and attention's six products per head (scores, output; the gradients of v, of the
// probabilities, of q and k) counted at half for the causal mask:
//   gemm lib=L threads=1 gpt_step ... us=
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench_util.h"

#if defined(WEAVE_GEMM_OPENBLAS)
#include <cblas.h>
constexpr const char* kLibrary = "openblas";
#elif defined(WEAVE_GEMM_BLIS)
#include <blis.h>
constexpr const char* kLibrary = "blis";
#else
#include "weave/kernels/cpu/eigen.h"
constexpr const char* kLibrary = "eigen";
#endif

namespace {

void set_threads(int threads) {
#if defined(WEAVE_GEMM_OPENBLAS)
  openblas_set_num_threads(threads);
#elif defined(WEAVE_GEMM_BLIS)
  bli_thread_set_num_threads(threads);
#else
  Eigen::setNbThreads(threads);
#endif
}

// C [m, n] = op(A) op(B), row-major; op(A) is [m, k] (A stored [k, m] when ta), op(B) [k, n].
void gemm(bool ta, bool tb, int m, int n, int k, const float* a, const float* b, float* c) {
#if defined(WEAVE_GEMM_OPENBLAS)
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n,
              k, 1.0f, a, ta ? m : k, b, tb ? k : n, 0.0f, c, n);
#elif defined(WEAVE_GEMM_BLIS)
  float one = 1.0f, zero = 0.0f;
  // row-major storage: row stride = leading dimension, column stride 1
  bli_sgemm(ta ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE, tb ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE, m, n,
            k, &one, const_cast<float*>(a), ta ? m : k, 1, const_cast<float*>(b), tb ? k : n, 1,
            &zero, c, n, 1);
#else
  using Row = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Col = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;
  Eigen::Map<Row> out(c, m, n);
  if (!ta && !tb)
    out.noalias() = Eigen::Map<const Row>(a, m, k) * Eigen::Map<const Row>(b, k, n);
  else if (!ta && tb)
    out.noalias() = Eigen::Map<const Row>(a, m, k) * Eigen::Map<const Col>(b, k, n);
  else if (ta && !tb)
    out.noalias() = Eigen::Map<const Col>(a, m, k) * Eigen::Map<const Row>(b, k, n);
  else
    out.noalias() = Eigen::Map<const Col>(a, m, k) * Eigen::Map<const Col>(b, k, n);
#endif
}

struct Shape {
  std::string name;
  bool ta, tb;
  int m, k, n;
};

double time_shape(const Shape& s, int reps) {
  std::vector<float> a(size_t(s.m) * s.k, 0.5f), b(size_t(s.k) * s.n, 0.25f), c(size_t(s.m) * s.n);
  auto run = [&] { gemm(s.ta, s.tb, s.m, s.n, s.k, a.data(), b.data(), c.data()); };
  run();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) t.push_back(weave::bench::seconds(run));
  return weave::bench::median(t);
}

std::vector<Shape> mlp_step(int batch) {
  const std::string b = std::to_string(batch);
  return {
      {"fwd1_b" + b, false, true, batch, 784, 256}, {"fwd2_b" + b, false, true, batch, 256, 128},
      {"fwd3_b" + b, false, true, batch, 128, 10},  {"dW1_b" + b, true, false, 256, batch, 784},
      {"dW2_b" + b, true, false, 128, batch, 256},  {"dW3_b" + b, true, false, 10, batch, 128},
      {"dX2_b" + b, false, false, batch, 128, 256}, {"dX3_b" + b, false, false, batch, 10, 128}};
}

// The GEMMs of one GPT step (forward and backward) in microseconds, median of reps each.
double gpt_step_us(int layers, int dim, int heads, int context, int batch, int vocab, int reps) {
  double linear_us = 0, attention_us = 0;
  for (const auto& p : weave::bench::gpt_step_products(layers, dim, heads, context, batch, vocab))
    (p.attention ? attention_us : linear_us) +=
        p.times * time_shape({p.name, p.transpose_a, p.transpose_b, p.m, p.k, p.n}, reps) * 1e6;
  std::printf(
      "gemm lib=%s threads=1 gpt_step layers=%d dim=%d heads=%d context=%d batch=%d "
      "vocab=%d linear_us=%.0f attention_us=%.0f us=%.0f\n",
      kLibrary, layers, dim, heads, context, batch, vocab, linear_us, attention_us,
      linear_us + attention_us);
  return linear_us + attention_us;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 8 && std::string(argv[1]) == "--gpt") {
    set_threads(1);
    gpt_step_us(std::stoi(argv[2]), std::stoi(argv[3]), std::stoi(argv[4]), std::stoi(argv[5]),
                std::stoi(argv[6]), std::stoi(argv[7]), 7);
    return 0;
  }
  const int reps = argc > 1 ? std::stoi(argv[1]) : 21;
  for (int threads : {1, 2}) {
    set_threads(threads);
    for (int batch : {64, 1024}) {
      double total = 0;
      for (const Shape& s : mlp_step(batch)) {
        const double t = time_shape(s, reps);
        total += t;
        std::printf("gemm lib=%s threads=%d shape=%s m=%d k=%d n=%d us=%.1f gflops=%.1f\n",
                    kLibrary, threads, s.name.c_str(), s.m, s.k, s.n, t * 1e6,
                    2.0 * s.m * s.k * s.n / t / 1e9);
      }
      std::printf("gemm lib=%s threads=%d mlp_step batch=%d us=%.1f\n", kLibrary, threads, batch,
                  total * 1e6);
    }
    for (int n : {256, 512, 1024, 2048}) {
      const Shape s{"square" + std::to_string(n), false, false, n, n, n};
      const double t = time_shape(s, n >= 1024 ? 5 : reps);
      std::printf("gemm lib=%s threads=%d shape=%s m=%d k=%d n=%d us=%.1f gflops=%.1f\n", kLibrary,
                  threads, s.name.c_str(), n, n, n, t * 1e6, 2.0 * n * n * n / t / 1e9);
    }
  }
  return 0;
}

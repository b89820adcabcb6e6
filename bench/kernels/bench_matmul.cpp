// weave matmul vs raw Eigen GEMM (float32), same threads, same run.
// ratio = eigen_time / weave_time (1.0 = as fast as Eigen, higher = faster).
#include <cstdio>

#include <weave/weave.h>
#include "bench_util.h"
#include "weave/kernels/cpu/eigen.h"

using namespace weave;

int main() {
  for (int64_t n : {256, 512, 1024}) {
    const int trials = n <= 256 ? 51 : n <= 512 ? 21 : 11;
    Tensor a = randn({n, n}), b = randn({n, n});
    Eigen::MatrixXf ea = Eigen::MatrixXf::Random(n, n), eb = Eigen::MatrixXf::Random(n, n);
    Eigen::MatrixXf ec(n, n);
    Tensor out;
    auto [weave_s, eigen_s] =
        bench::alternate([&] { out = matmul(a, b); }, [&] { ec.noalias() = ea * eb; }, trials);
    const double flops = 2.0 * double(n) * double(n) * double(n);
    std::printf(
        "name=matmul_f32 n=%ld threads=%d weave_ms=%.3f eigen_ms=%.3f weave_gflops=%.1f "
        "eigen_gflops=%.1f ratio=%.3f\n",
        long(n), num_threads(), weave_s * 1e3, eigen_s * 1e3, flops / weave_s * 1e-9,
        flops / eigen_s * 1e-9, eigen_s / weave_s);
  }
}

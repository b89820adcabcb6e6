// CPU GEMM: every operand row- or column-major, batched over the leading dim. float32 and
// float64 go through OpenBLAS when weave is built with it (faster than Eigen on this project's
// shapes at one and two threads: README, "GEMM"), else through Eigen.
#include "weave/kernels/cpu/gemm.h"

#include <omp.h>

#include <algorithm>
#include <atomic>

#include "weave/kernels/backends.h"
#include "weave/kernels/cpu/eigen.h"
#include "weave/kernels/kernels.h"

#ifdef WEAVE_WITH_OPENBLAS
#include <cblas.h>
#endif

namespace weave::kernels::cpu {

namespace {

#ifdef WEAVE_WITH_OPENBLAS
constexpr int64_t kIntMax = 0x7fffffff;  // BLAS takes int sizes

// OpenBLAS keeps its own thread pool: follow weave's budget (set_num_threads, OMP_NUM_THREADS).
void sync_blas_threads() {
  static std::atomic<int> applied{0};
  const int budget = max_threads();
  if (applied.exchange(budget, std::memory_order_relaxed) != budget)
    openblas_set_num_threads(budget);
}
#endif

template <class T>
void eigen_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
                int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  using Stride = Eigen::OuterStride<>;
  using RowMap = Eigen::Map<const RowMajor<T>, 0, Stride>;
  using ColMap = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>, 0, Stride>;
  Eigen::Map<RowMajor<T>, 0, Stride> result(c, m, n, Stride(ldc));
  auto store = [&](const auto& product) {
    if (beta == T(0))
      result.noalias() = alpha * product;
    else {
      if (beta != T(1)) result *= beta;
      result.noalias() += alpha * product;
    }
  };
  // A transposed row-major operand is the same memory read column-major: Eigen picks its GEMM
  // kernel from the storage orders, no copy.
  if (!trans_a && !trans_b)
    store(RowMap(a, m, k, Stride(lda)) * RowMap(b, k, n, Stride(ldb)));
  else if (trans_a && !trans_b)
    store(ColMap(a, m, k, Stride(lda)) * RowMap(b, k, n, Stride(ldb)));
  else if (!trans_a && trans_b)
    store(RowMap(a, m, k, Stride(lda)) * ColMap(b, k, n, Stride(ldb)));
  else
    store(ColMap(a, m, k, Stride(lda)) * ColMap(b, k, n, Stride(ldb)));
}

}  // namespace

template <class T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
          int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
#ifdef WEAVE_WITH_OPENBLAS
  const bool fits = m <= kIntMax && n <= kIntMax && k <= kIntMax && lda <= kIntMax &&
                    ldb <= kIntMax && ldc <= kIntMax;
  if (fits && k > 0 && !omp_in_parallel()) {
    sync_blas_threads();
    const auto ta = trans_a ? CblasTrans : CblasNoTrans, tb = trans_b ? CblasTrans : CblasNoTrans;
    if constexpr (std::is_same_v<T, float>)
      cblas_sgemm(CblasRowMajor, ta, tb, int(m), int(n), int(k), alpha, a, int(lda), b, int(ldb),
                  beta, c, int(ldc));
    else
      cblas_dgemm(CblasRowMajor, ta, tb, int(m), int(n), int(k), alpha, a, int(lda), b, int(ldb),
                  beta, c, int(ldc));
    return;
  }
#endif
  eigen_gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

template void gemm<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t,
                          const float*, int64_t, float, float*, int64_t);
template void gemm<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*, int64_t,
                           const double*, int64_t, double, double*, int64_t);

namespace {

// Each operand row-major (inner stride 1) or column-major (row stride 1): the front end copied
// anything else. A column-major operand is its transpose stored row-major.
template <class T>
void matmul_typed(const Tensor& a, const Tensor& b, const Tensor& out, bool accumulate) {
  const int64_t batch = out.size(0), m = out.size(1), n = out.size(2), k = a.size(2);
  const bool a_col = a.strides()[2] != 1, b_col = b.strides()[2] != 1;
  // leading dimensions; a size-1 dim's stride is arbitrary, so it falls back to the minimum
  const int64_t lda = a_col ? std::max(a.strides()[2], m) : std::max(a.strides()[1], k);
  const int64_t ldb = b_col ? std::max(b.strides()[2], k) : std::max(b.strides()[1], n);
  const T* pa = static_cast<const T*>(a.data_ptr());
  const T* pb = static_cast<const T*>(b.data_ptr());
  T* po = static_cast<T*>(out.data_ptr());
  for (int64_t i = 0; i < batch; ++i)
    gemm<T>(a_col, b_col, m, n, k, T(1), pa + i * a.strides()[0], lda, pb + i * b.strides()[0], ldb,
            accumulate ? T(1) : T(0), po + i * m * n, n);
}

// A 3-D matmul operand in float32, its batch kept broadcast (stride 0) where it was.
Tensor widened(const Tensor& t) {
  const bool broadcast = t.strides()[0] == 0;
  const Tensor source =
      broadcast ? make_view(t, {1, t.size(1), t.size(2)},
                            {t.size(1) * t.size(2), t.strides()[1], t.strides()[2]}, t.offset())
                : t;
  Tensor wide = empty(source.shape());
  copy(source, wide);
  if (!broadcast) return wide;
  return make_view(wide, t.shape(), {0, wide.strides()[1], wide.strides()[2]}, 0);
}

// Reduced precision without a oneDNN implementation: the same product in float32 (inputs
// widened exactly, one rounding at the end), which is what oneDNN's float32 accumulation gives.
void widened_matmul(const Tensor& a, const Tensor& b, const Tensor& out, bool accumulate) {
  Tensor wide_out = empty(out.shape());
  if (accumulate) copy(out, wide_out);
  matmul_typed<float>(widened(a), widened(b), wide_out, accumulate);
  copy(wide_out, out);
}

}  // namespace

void matmul(const Tensor& a, const Tensor& b, const Tensor& out, bool accumulate) {
  if (a.dtype() == kFloat32) return matmul_typed<float>(a, b, out, accumulate);
  if (a.dtype() == kFloat64) return matmul_typed<double>(a, b, out, accumulate);
  if (a.dtype() == kBFloat16 || a.dtype() == kFloat16) {
    if (!reduced_precision_matmul(a, b, out, accumulate)) widened_matmul(a, b, out, accumulate);
    return;
  }
  WEAVE_FAIL("matmul",
             "expected a floating dtype (float32, float64, bfloat16, float16), found {}; hint: "
             ".to(kFloat32)",
             a.dtype());
}

}  // namespace weave::kernels::cpu

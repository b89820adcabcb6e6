// CPU GEMM: every operand row- or column-major, batched over the leading dim. float32 and
// float64 go through OpenBLAS when weave is built with it (faster than Eigen on this project's
// shapes at one and two threads: README, "GEMM"), else through Eigen.
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
// OpenBLAS keeps its own thread pool: follow weave's budget (set_num_threads, OMP_NUM_THREADS).
void sync_blas_threads() {
  static std::atomic<int> applied{0};
  const int budget = max_threads();
  if (applied.exchange(budget, std::memory_order_relaxed) != budget)
    openblas_set_num_threads(budget);
}

template <class T>
void blas_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t m, int64_t n, int64_t k, const T* a,
               int64_t lda, const T* b, int64_t ldb, T* c, T beta) {
  if constexpr (std::is_same_v<T, float>)
    cblas_sgemm(CblasRowMajor, ta, tb, int(m), int(n), int(k), 1.0f, a, int(lda), b, int(ldb), beta,
                c, int(n));
  else
    cblas_dgemm(CblasRowMajor, ta, tb, int(m), int(n), int(k), 1.0, a, int(lda), b, int(ldb), beta,
                c, int(n));
}

// True when done: each operand row-major (inner stride 1) or column-major (row stride 1),
// sizes within BLAS's int.
template <class T>
bool matmul_blas(const Tensor& a, const Tensor& b, const Tensor& out, bool accumulate) {
  const int64_t batch = out.size(0), m = out.size(1), n = out.size(2), k = a.size(2);
  constexpr int64_t kIntMax = 0x7fffffff;
  if (m == 0 || n == 0 || k == 0 || m > kIntMax || n > kIntMax || k > kIntMax) return false;
  sync_blas_threads();
  const bool a_col = a.strides()[2] != 1, b_col = b.strides()[2] != 1;
  // leading dimensions; a size-1 dim's stride is arbitrary, so it falls back to the minimum
  const int64_t lda = a_col ? std::max(a.strides()[2], m) : std::max(a.strides()[1], k);
  const int64_t ldb = b_col ? std::max(b.strides()[2], k) : std::max(b.strides()[1], n);
  if (lda > kIntMax || ldb > kIntMax) return false;
  const T* pa = static_cast<const T*>(a.data_ptr());
  const T* pb = static_cast<const T*>(b.data_ptr());
  T* po = static_cast<T*>(out.data_ptr());
  for (int64_t i = 0; i < batch; ++i)
    blas_gemm<T>(a_col ? CblasTrans : CblasNoTrans, b_col ? CblasTrans : CblasNoTrans, m, n, k,
                 pa + i * a.strides()[0], lda, pb + i * b.strides()[0], ldb, po + i * m * n,
                 accumulate ? T(1) : T(0));
  return true;
}
#endif

template <class T>
void matmul_typed(const Tensor& a, const Tensor& b, const Tensor& out, bool accumulate) {
  const int64_t batch = out.size(0), m = out.size(1), n = out.size(2), k = a.size(2);
  const T* pa = static_cast<const T*>(a.data_ptr());
  const T* pb = static_cast<const T*>(b.data_ptr());
  T* po = static_cast<T*>(out.data_ptr());
  // Each operand is row-major (inner stride 1) or column-major (row stride 1); the front end
  // copied anything else. Eigen picks its GEMM kernel from the storage orders, no copy here.
  for (int64_t i = 0; i < batch; ++i) {
    Eigen::Map<RowMajor<T>> result(po + i * m * n, m, n);
    const T* ai = pa + i * a.strides()[0];
    const T* bi = pb + i * b.strides()[0];
    const bool a_col = a.strides()[2] != 1, b_col = b.strides()[2] != 1;
    using ColMap =
        Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>, 0, Eigen::OuterStride<>>;
    using RowMap = Eigen::Map<const RowMajor<T>, 0, Eigen::OuterStride<>>;
    auto store = [&](const auto& product) {
      if (accumulate)
        result.noalias() += product;
      else
        result.noalias() = product;
    };
    if (!a_col && !b_col)
      store(RowMap(ai, m, k, Eigen::OuterStride<>(a.strides()[1])) *
            RowMap(bi, k, n, Eigen::OuterStride<>(b.strides()[1])));
    else if (a_col && !b_col)
      store(ColMap(ai, m, k, Eigen::OuterStride<>(a.strides()[2])) *
            RowMap(bi, k, n, Eigen::OuterStride<>(b.strides()[1])));
    else if (!a_col && b_col)
      store(RowMap(ai, m, k, Eigen::OuterStride<>(a.strides()[1])) *
            ColMap(bi, k, n, Eigen::OuterStride<>(b.strides()[2])));
    else
      store(ColMap(ai, m, k, Eigen::OuterStride<>(a.strides()[2])) *
            ColMap(bi, k, n, Eigen::OuterStride<>(b.strides()[2])));
  }
}

}  // namespace

void matmul(const Tensor& a, const Tensor& b, const Tensor& out, bool accumulate) {
#ifdef WEAVE_WITH_OPENBLAS
  if (a.dtype() == kFloat32 && matmul_blas<float>(a, b, out, accumulate)) return;
  if (a.dtype() == kFloat64 && matmul_blas<double>(a, b, out, accumulate)) return;
#endif
  if (a.dtype() == kFloat32) return matmul_typed<float>(a, b, out, accumulate);
  if (a.dtype() == kFloat64) return matmul_typed<double>(a, b, out, accumulate);
  WEAVE_FAIL("matmul", "CPU matmul supports float32 and float64, found {}; hint: .to(kFloat32)",
             a.dtype());
}

}  // namespace weave::kernels::cpu

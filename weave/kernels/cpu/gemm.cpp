// CPU GEMM through Eigen: every operand row- or column-major, batched over the leading dim.
#include "weave/kernels/backends.h"
#include "weave/kernels/cpu/eigen.h"

namespace weave::kernels::cpu {

namespace {

template <class T>
void matmul_typed(const Tensor& a, const Tensor& b, const Tensor& out) {
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
    if (!a_col && !b_col)
      result.noalias() = RowMap(ai, m, k, Eigen::OuterStride<>(a.strides()[1])) *
                         RowMap(bi, k, n, Eigen::OuterStride<>(b.strides()[1]));
    else if (a_col && !b_col)
      result.noalias() = ColMap(ai, m, k, Eigen::OuterStride<>(a.strides()[2])) *
                         RowMap(bi, k, n, Eigen::OuterStride<>(b.strides()[1]));
    else if (!a_col && b_col)
      result.noalias() = RowMap(ai, m, k, Eigen::OuterStride<>(a.strides()[1])) *
                         ColMap(bi, k, n, Eigen::OuterStride<>(b.strides()[2]));
    else
      result.noalias() = ColMap(ai, m, k, Eigen::OuterStride<>(a.strides()[2])) *
                         ColMap(bi, k, n, Eigen::OuterStride<>(b.strides()[2]));
  }
}

}  // namespace

void matmul(const Tensor& a, const Tensor& b, const Tensor& out) {
  if (a.dtype() == kFloat32) return matmul_typed<float>(a, b, out);
  if (a.dtype() == kFloat64) return matmul_typed<double>(a, b, out);
  WEAVE_FAIL("matmul", "CPU matmul supports float32 and float64, found {}; hint: .to(kFloat32)",
             a.dtype());
}

}  // namespace weave::kernels::cpu

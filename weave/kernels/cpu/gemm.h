#pragma once
// One row-major GEMM for the CPU kernels that multiply blocks of their own (attention):
// C = alpha op(A) op(B) + beta C, every matrix with its own leading dimension. OpenBLAS when
// weave has it and the caller runs on one thread; inside an OpenMP parallel region Eigen
// instead, which then stays on the calling thread (OpenBLAS's own pool would oversubscribe).
#include <cstdint>

#include "weave/tensor/tensor.h"

namespace weave::kernels::cpu {

template <class T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
          int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc);

/// bfloat16 / float16 matmul with matmul's contract (kernels.h) through oneDNN (dnnl.cpp); false
/// when this build or CPU has no implementation for the problem (no_dnnl.cpp: always), and
/// the caller computes it in float32 instead.
bool reduced_precision_matmul(const Tensor& a, const Tensor& b, const Tensor& out, bool accumulate);

}  // namespace weave::kernels::cpu

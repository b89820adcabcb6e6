// CUDA matmul through cuBLAS (strided batched GEMM, one handle per device).
#include <cublas_v2.h>

#include <mutex>

#include "weave/kernels/backends.h"
#include "weave/tensor/cuda/common.cuh"

namespace weave::kernels::cuda {

namespace {

cublasHandle_t handle(int device) {
  static std::mutex mutex;
  static cublasHandle_t handles[64] = {};
  std::lock_guard lock(mutex);
  if (handles[device] == nullptr) {
    weave::cuda::DeviceGuard guard(device);
    cublasStatus_t status = cublasCreate(&handles[device]);
    WEAVE_CHECK(status == CUBLAS_STATUS_SUCCESS, "matmul", "cublasCreate failed: {}",
                cublasGetStatusString(status));
    cublasSetStream(handles[device], weave::cuda::stream(device));
  }
  return handles[device];
}

// cuBLAS is column-major, so the row-major C = A B is computed as C^T = B^T A^T. A row-major
// operand is its own transpose in column-major terms (no op); a column-major one needs op T.
struct Operand {
  cublasOperation_t op;
  int64_t ld;
};
Operand describe(const Tensor& t) {
  const int64_t rs = t.strides()[1], cs = t.strides()[2];
  if (cs == 1) return {CUBLAS_OP_N, std::max<int64_t>(rs, 1)};
  return {CUBLAS_OP_T, std::max<int64_t>(cs, 1)};
}

}  // namespace

void matmul(const Tensor& a, const Tensor& b, const Tensor& out) {
  const int64_t batch = out.size(0), m = out.size(1), n = out.size(2), k = a.size(2);
  const int device = out.device().index;
  weave::cuda::DeviceGuard guard(device);
  Operand oa = describe(a), ob = describe(b);
  cublasStatus_t status;
  if (a.dtype() == kFloat32) {
    const float alpha = 1, beta = 0;
    status = cublasSgemmStridedBatched(
        handle(device), ob.op, oa.op, int(n), int(m), int(k), &alpha,
        static_cast<const float*>(b.data_ptr()), int(ob.ld), b.strides()[0],
        static_cast<const float*>(a.data_ptr()), int(oa.ld), a.strides()[0], &beta,
        static_cast<float*>(out.data_ptr()), int(n), m * n, int(batch));
  } else if (a.dtype() == kFloat64) {
    const double alpha = 1, beta = 0;
    status = cublasDgemmStridedBatched(
        handle(device), ob.op, oa.op, int(n), int(m), int(k), &alpha,
        static_cast<const double*>(b.data_ptr()), int(ob.ld), b.strides()[0],
        static_cast<const double*>(a.data_ptr()), int(oa.ld), a.strides()[0], &beta,
        static_cast<double*>(out.data_ptr()), int(n), m * n, int(batch));
  } else {
    WEAVE_FAIL("matmul", "CUDA matmul supports float32 and float64, found {}; hint: .to(kFloat32)",
               a.dtype());
  }
  WEAVE_CHECK(status == CUBLAS_STATUS_SUCCESS, "matmul", "cuBLAS GEMM failed: {}",
              cublasGetStatusString(status));
}

}  // namespace weave::kernels::cuda

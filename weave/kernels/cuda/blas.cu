// CUDA matmul through cuBLAS (strided batched GEMM, one handle per device).
#include <cublas_v2.h>

#include <mutex>
#include <string>

#include "weave/kernels/backends.h"
#include "weave/tensor/cuda/common.cuh"

namespace weave::detail {
inline bool call_succeeded(cublasStatus_t status) {
  return status == CUBLAS_STATUS_SUCCESS;
}
inline std::string call_error(cublasStatus_t status) {
  return fmt::format("{} (cuBLAS {})", cublasGetStatusString(status), cublasGetStatusName(status));
}
}  // namespace weave::detail

namespace weave::kernels::cuda {

namespace {

// One handle per device, created once and bound to weave's stream of that device; later calls
// read it without a lock (weave issues all of a device's GEMMs on that one stream). It owns a
// workspace of its own from the start, so that cuBLAS never allocates one while a CUDA graph
// captures (32 MiB: what Hopper's kernels ask for, as PyTorch sets it).
cublasHandle_t handle(int device) {
  constexpr int kMaxDevices = 64;
  static std::once_flag created[kMaxDevices];
  static cublasHandle_t handles[kMaxDevices] = {};
  WEAVE_CHECK(device >= 0 && device < kMaxDevices, "matmul", "cuda:{} is out of range", device);
  std::call_once(created[device], [device] {
    weave::cuda::DeviceGuard guard(device);
    WEAVE_CHECK_CALL(cublasCreate(&handles[device]), "matmul");
    WEAVE_CHECK_CALL(cublasSetStream(handles[device], weave::cuda::stream(device)), "matmul");
    constexpr size_t kWorkspace = size_t{32} << 20;
    void* workspace = nullptr;  // never freed: the handle lives as long as the process
    WEAVE_CHECK_CALL(cudaMalloc(&workspace, kWorkspace), "matmul");
    WEAVE_CHECK_CALL(cublasSetWorkspace(handles[device], workspace, kWorkspace), "matmul");
  });
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

void matmul(const Tensor& a, const Tensor& b, const Tensor& out, bool accumulate) {
  const int64_t batch = out.size(0), m = out.size(1), n = out.size(2), k = a.size(2);
  const int device = out.device().index;
  weave::cuda::DeviceGuard guard(device);
  Operand oa = describe(a), ob = describe(b);
  if (a.dtype() == kFloat64) {
    const double alpha = 1, beta = accumulate ? 1 : 0;
    WEAVE_CHECK_CALL(cublasDgemmStridedBatched(
                         handle(device), ob.op, oa.op, int(n), int(m), int(k), &alpha,
                         static_cast<const double*>(b.data_ptr()), int(ob.ld), b.strides()[0],
                         static_cast<const double*>(a.data_ptr()), int(oa.ld), a.strides()[0],
                         &beta, static_cast<double*>(out.data_ptr()), int(n), m * n, int(batch)),
                     "matmul");
    return;
  }
  // float32 (TF32 tensor cores when float32_matmul_precision allows), bfloat16 and float16
  // (tensor cores, float32 accumulation): one cublasGemmStridedBatchedEx.
  cudaDataType_t type;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  if (a.dtype() == kFloat32) {
    type = CUDA_R_32F;
    if (float32_matmul_precision() == Float32MatmulPrecision::High)
      compute = CUBLAS_COMPUTE_32F_FAST_TF32;
  } else if (a.dtype() == kBFloat16) {
    type = CUDA_R_16BF;
  } else if (a.dtype() == kFloat16) {
    type = CUDA_R_16F;
  } else {
    WEAVE_FAIL("matmul",
               "expected a floating dtype (float32, float64, bfloat16, float16), found {}; hint: "
               ".to(kFloat32)",
               a.dtype());
  }
  const float alpha = 1, beta = accumulate ? 1 : 0;
  WEAVE_CHECK_CALL(
      cublasGemmStridedBatchedEx(handle(device), ob.op, oa.op, int(n), int(m), int(k), &alpha,
                                 b.data_ptr(), type, int(ob.ld), b.strides()[0], a.data_ptr(), type,
                                 int(oa.ld), a.strides()[0], &beta, out.data_ptr(), type, int(n),
                                 m * n, int(batch), compute, CUBLAS_GEMM_DEFAULT),
      "matmul");
}

}  // namespace weave::kernels::cuda

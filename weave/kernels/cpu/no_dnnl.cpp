// Built without oneDNN: reduced-precision matmul takes the float32 fallback (gemm.cpp).
#include "weave/kernels/cpu/gemm.h"

namespace weave::kernels::cpu {

bool reduced_precision_matmul(const Tensor&, const Tensor&, const Tensor&, bool) {
  return false;
}

}  // namespace weave::kernels::cpu

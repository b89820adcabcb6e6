#pragma once
// What the optimizers' sources share; not part of the API.
#include "weave/ops/ops.h"

namespace weave::optim::detail {

/// The common case, in one fused pass without temporaries: contiguous, one floating dtype.
inline bool fuses(const Tensor& p, const Tensor& g) {
  return is_floating(p.dtype()) && g.dtype() == p.dtype() && g.device() == p.device() &&
         p.is_contiguous() && g.is_contiguous();
}

/// Optimizer state lives in the parameter's compute dtype: float32 for bfloat16/float16, so
/// that the moments keep the small values reduced precision would flush or round away.
inline TensorOptions state_options(const Tensor& p) {
  return {.dtype = compute_dtype(p.dtype()), .device = p.device()};
}

}  // namespace weave::optim::detail

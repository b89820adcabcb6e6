// The autocast state and its policy table.
#include "weave/ops/autocast.h"

#include <cstring>

#include "weave/autograd/engine.h"

namespace weave {

namespace {

thread_local std::optional<DType> autocast_state;

struct PolicyRow {
  const char* op;
  AutocastPolicy policy;
};

// The one policy table (documented in autocast.h).
constexpr PolicyRow kPolicy[] = {
    {"matmul", AutocastPolicy::LowPrecision},
    {"linear", AutocastPolicy::LowPrecision},
    {"grouped_linear", AutocastPolicy::LowPrecision},
    {"scaled_dot_product_attention", AutocastPolicy::LowPrecision},
    {"bias_gelu", AutocastPolicy::LowPrecision},
    {"softmax", AutocastPolicy::Float32},
    {"log_softmax", AutocastPolicy::Float32},
    {"layer_norm", AutocastPolicy::Float32},
    {"rms_norm", AutocastPolicy::Float32},
    {"cross_entropy", AutocastPolicy::Float32},
    {"mse_loss", AutocastPolicy::Float32},
    {"sum", AutocastPolicy::Float32},
    {"mean", AutocastPolicy::Float32},
    {"var", AutocastPolicy::Float32},
    {"exp", AutocastPolicy::Float32},
    {"log", AutocastPolicy::Float32},
    {"pow", AutocastPolicy::Float32},
};

}  // namespace

AutocastPolicy autocast_policy(const char* op) {
  for (const PolicyRow& row : kPolicy)
    if (std::strcmp(row.op, op) == 0) return row.policy;
  return AutocastPolicy::FollowInputs;
}

std::optional<DType> autocast_dtype() {
  return autocast_state;
}

AutocastGuard::AutocastGuard(DType dtype, bool enabled) : previous_(autocast_state) {
  // A disabled guard casts nothing, so any dtype will do (AutocastGuard(kFloat32, use_amp)).
  WEAVE_CHECK(!enabled || dtype == kBFloat16 || dtype == kFloat16, "autocast",
              "expected kBFloat16 or kFloat16, found {}; hint: autocast picks the reduced "
              "precision of the low-precision ops; float32 ops stay float32 by themselves",
              dtype);
  autocast_state = enabled ? std::optional<DType>(dtype) : std::nullopt;
}

AutocastGuard::~AutocastGuard() {
  autocast_state = previous_;
}

namespace detail {

Tensor autocast_input(const Tensor& t, const char* op, const char* what) {
  if (!autocast_state || !t.defined() || t.dtype() == kFloat64 || autograd::in_backward())
    return t;  // (float64 is never autocast: it was asked for explicitly)
  const AutocastPolicy policy = autocast_policy(op);
  if (policy == AutocastPolicy::FollowInputs) return t;
  if (!is_floating(t.dtype())) {
    WEAVE_CHECK(policy != AutocastPolicy::LowPrecision, op,
                "autocast({}) expected a floating {}, found {}; hint: autocast casts floating "
                "tensors only (an integer above 256 would round in bfloat16): convert it with "
                ".to(kFloat32) first",
                *autocast_state, what, t.dtype());
    return t;
  }
  const DType target = policy == AutocastPolicy::LowPrecision ? *autocast_state : kFloat32;
  return t.dtype() == target ? t : t.to(target);
}

}  // namespace detail

}  // namespace weave

#pragma once
// Automatic mixed precision: inside an AutocastGuard, the ops that gain most from reduced
// precision (matrix products, attention) run in bfloat16 or float16, the ops that lose accuracy
// in it (softmax, normalization, losses, reductions, exp/log) run in float32, and the rest follow
// their inputs (promotion: bfloat16 with float32 gives float32). Parameters stay float32; their
// gradients come back float32, since the gradient of a cast is the cast back.
//
//   nn::Linear layer(784, 256);                   // float32 parameters
//   Tensor loss;
//   {
//     AutocastGuard autocast(kBFloat16);
//     loss = cross_entropy(model(x), target);     // linear in bfloat16, the loss in float32
//   }
//   loss.backward();                              // float32 gradients on the parameters
//
// The policy is one table (autocast_policy), by op name:
//
//   | policy        | ops                                                                    |
//   |---------------|------------------------------------------------------------------------|
//   | low precision | matmul, linear, grouped_linear, scaled_dot_product_attention,          |
//   |               | bias_gelu                                                              |
//   | float32       | softmax, log_softmax, layer_norm, rms_norm, cross_entropy, mse_loss,   |
//   |               | sum, mean, var, exp, log, pow                                          |
//   | follow inputs | everything else                                                        |
//
// bias_gelu is linear's bias epilogue: under autocast it runs in the linear's reduced dtype, as
// a bias inside a low-precision linear would (a float32 bias would otherwise promote the whole
// activation to float32, three passes over the largest tensor of an MLP instead of one).
// Only floating tensors are cast. A low-precision op given an integer tensor raises (autocast
// would round integers above 256 in bfloat16 silently); convert it first. The state is per
// thread; guards nest (the innermost wins; AutocastGuard(dtype, false) turns it off inside).
// Backward never autocasts: each op's backward runs in the dtypes its forward used.
#include <optional>

#include "weave/tensor/tensor.h"

namespace weave {

enum class AutocastPolicy { LowPrecision, Float32, FollowInputs };

/// The policy of the op named `op` (as in its error messages: "matmul", "softmax", ...).
AutocastPolicy autocast_policy(const char* op);

/// The dtype this thread autocasts low-precision ops to, or nullopt when autocast is off.
std::optional<DType> autocast_dtype();

/// While alive, ops on this thread follow the autocast policy with `dtype` (kBFloat16 or
/// kFloat16; anything else raises). enabled = false turns autocast off in its scope, whatever
/// the dtype (AutocastGuard(kFloat32, use_amp) is a no-op when use_amp is false).
class AutocastGuard {
 public:
  explicit AutocastGuard(DType dtype, bool enabled = true);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  std::optional<DType> previous_;
};

namespace detail {
/// t as op's autocast policy wants it on this thread (t itself when autocast is off, the op
/// follows its inputs, t is undefined or not floating, or it already has the dtype). Casts
/// record autograd (the gradient is cast back). Integer tensors given to a low-precision op
/// raise, naming op and `what`.
Tensor autocast_input(const Tensor& t, const char* op, const char* what = "input");
}  // namespace detail

}  // namespace weave

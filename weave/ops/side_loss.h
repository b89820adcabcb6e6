#pragma once
// Losses that join the objective away from the step's loss. A mixture of experts' balancing
// loss computed on a pipeline stage before the last cannot be added to the loss, which only the
// last stage computes: it travels with the stage's activation instead, and is differentiated
// when that activation's gradient comes back (Megatron-core's MoEAuxLossAutoScaler).
//
//   Tensor y = blocks(x);                     // a stage before the last, in training
//   y = attach_loss(y, moe_aux_loss);         // y's values; backward through y adds the aux's
#include "weave/ops/ops.h"

namespace weave {

/// `y`'s values (a view of it, with a node of its own): where backward reaches it, `loss` (a
/// scalar) is differentiated too, with the gradient side_loss_scale() held when attached (1
/// without a SideLossScope), and `loss` times that scale adds to the open scope's total().
Tensor attach_loss(const Tensor& y, const Tensor& loss);

/// While alive on this thread, attached losses take gradient `scale` (a pipeline opens one with
/// 1 / micro-batches for its step, whose loss is the mean of theirs) and their scaled values add
/// up in total(), so that the step can report the whole loss.
class SideLossScope {
 public:
  explicit SideLossScope(double scale);
  ~SideLossScope();
  SideLossScope(const SideLossScope&) = delete;
  SideLossScope& operator=(const SideLossScope&) = delete;
  /// The scaled sum of the losses attached in this scope (float64, [1], on the CPU).
  Tensor total() const;

 private:
  friend Tensor attach_loss(const Tensor& y, const Tensor& loss);
  double scale_;
  Tensor total_;
  SideLossScope* outer_;
};

}  // namespace weave

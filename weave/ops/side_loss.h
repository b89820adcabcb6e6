#pragma once
// Losses that join the objective away from the step's loss. A mixture of experts' balancing
// loss travels with the layer's output instead of being added to the loss by the trainer, and is
// differentiated when that output's gradient comes back (Megatron-core's MoEAuxLossAutoScaler):
// one rule whether the loss is computed on this rank or on a later pipeline stage's.
//
//   Tensor y = moe(x);                        // in training
//   y = attach_loss(y, moe.aux_loss());       // y's values; backward through y adds the aux's
#include "weave/ops/ops.h"

namespace weave {

/// `y`'s values (a view of it, with a node of its own): where backward reaches it, `loss` (a
/// scalar) is differentiated too, with the gradient the open SideLossScope's scale held when
/// attached (1 without one) times attached_loss_gradient_factor() when backward runs, and `loss`
/// times that scale adds to the open scope's total().
Tensor attach_loss(const Tensor& y, const Tensor& loss);

/// The factor the step's loss is multiplied by before backward, which attached losses' gradients
/// take too (1 by default): parallel::GradScaler::scale() sets its scale, its update() 1.
void set_attached_loss_gradient_factor(double factor);
double attached_loss_gradient_factor();

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
  /// Whether any loss was attached in this scope.
  bool attached() const { return total_.defined(); }

 private:
  friend Tensor attach_loss(const Tensor& y, const Tensor& loss);
  double scale_;
  Tensor total_;
  SideLossScope* outer_;
};

}  // namespace weave

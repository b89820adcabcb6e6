#pragma once
// examples/gpt's optimizer step: AdamW over the GPT recipe's groups (no weight decay on biases,
// norms and embeddings; under fsdp this rank's shards, each part in its parameter's group),
// clipped by the whole model's norm, through the fp16 loss scaler; or under --strategy zero,
// ZeRO-1: each rank's AdamW steps its slice of the flattened parameters, the gradients averaged
// (reduce-scattered, reproducibly under --reproducible) and clipped inside its step.
#include <weave/weave.h>

#include "flags.h"

#include <memory>
#include <vector>

namespace gpt {

/// ZeRO-1 over the data x context ranks: each rank's AdamW steps its slice of the flattened
/// parameters, each part in its parameter's weight-decay group, clipped to max_norm in the step.
inline std::unique_ptr<parallel::ZeroRedundancyOptimizer> make_zero(
    const Flags& f, nn::Module& model, const parallel::ProcessMesh& mesh, double max_norm) {
  return std::make_unique<parallel::ZeroRedundancyOptimizer>(
      optim::weight_decay_groups(model, f.weight_decay),
      [lr = f.lr](std::vector<optim::ParamGroup> slice) {
        return std::unique_ptr<optim::Optimizer>(
            std::make_unique<optim::AdamW>(slice, optim::AdamWOptions{.lr = lr}));
      },
      mesh.data_and_context(),
      parallel::ZeroOptions{.max_grad_norm = max_norm, .reproducible = f.reproducible});
}

/// AdamW over the GPT recipe's groups: through `wrapper` (each FSDP shard's parts in their
/// parameter's group) when there is one, over the model's own parameters otherwise.
inline std::unique_ptr<optim::AdamW> make_adamw(const Flags& f, nn::Module& model,
                                                const parallel::DataParallelWrapper* wrapper) {
  const std::vector<optim::ParamGroup> groups = optim::weight_decay_groups(model, f.weight_decay);
  return std::make_unique<optim::AdamW>(
      wrapper ? wrapper->param_groups(groups) : groups,
      optim::AdamWOptions{.lr = f.lr, .capturable = f.cuda_graph});
}

class Stepper {
 public:
  Stepper(const Flags& f, nn::Module& model, parallel::DataParallelWrapper& wrapper,
          const parallel::ProcessMesh& mesh) {
    if (f.strategy == "zero")
      zero_ = make_zero(f, model, mesh, f.clip);
    else
      adamw_ = make_adamw(f, model, &wrapper);
  }

  /// What the schedule, checkpoints and a captured step drive: AdamW, or ZeRO's slice's.
  optim::Optimizer& optimizer() { return zero_ ? zero_->shard_optimizer() : *adamw_; }
  void zero_grad() { zero_ ? zero_->zero_grad() : adamw_->zero_grad(); }
  /// Clips and steps (the scaler unscaling, skipping and updating; ZeRO-1 runs without one);
  /// returns the whole model's gradient norm before clipping.
  double step(parallel::GradScaler& scaler, double clip) {
    if (zero_) {
      zero_->step();
      return zero_->last_grad_norm();
    }
    scaler.unscale_(adamw_->params());  // clipping sees the true gradients
    const double norm = parallel::clip_grad_norm_(adamw_->params(), clip);
    scaler.step(*adamw_);
    scaler.update();
    return norm;
  }

 private:
  std::unique_ptr<optim::AdamW> adamw_;
  std::unique_ptr<parallel::ZeroRedundancyOptimizer> zero_;
};

}  // namespace gpt

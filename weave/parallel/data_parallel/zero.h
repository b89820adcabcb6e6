#pragma once
// ZeRO stage 1: the optimizer state is sharded. Each rank of the group keeps (and updates) the
// optimizer state of a 1/N slice of the flattened parameters only:
//   1. the gradients, flattened, are reduce-scattered (averaged): each rank gets its slice;
//   2. the wrapped optimizer steps that slice of the parameters;
//   3. the updated slices are all-gathered back into every rank's parameters.
// The step equals an unsharded data-parallel step; memory for optimizer state drops to 1/N.
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "weave/distributed/distributed.h"
#include "weave/optim/optimizer.h"
#include "weave/parallel/core/joinable.h"
#include "weave/parallel/core/replicas.h"

namespace weave::parallel {

namespace detail {
struct FlatBuffer;
class ReproducibleGradients;
}  // namespace detail

/// Builds the optimizer of this rank's slice from parameter groups over it (each part of the
/// slice in its parameter's group), e.g.
/// `[](std::vector<optim::ParamGroup> g) { return std::make_unique<optim::AdamW>(g, {...}); }`.
using GroupedOptimizerFactory =
    std::function<std::unique_ptr<optim::Optimizer>(std::vector<optim::ParamGroup>)>;

struct ZeroOptions {
  /// Skip the step on every rank when any rank's gradients hold NaN or infinity: each rank's
  /// verdict travels in the reduce-scatter itself (one extra element per rank), so the check
  /// costs one pass over the local gradients and no extra communication.
  bool check_finite = false;
  /// Clip inside step(): once the gradients are averaged, scale this rank's slice so that the
  /// norm of the whole averaged gradient (every rank's slice counted: one more all_reduce of
  /// one number) is at most this; last_grad_norm() reports it. Unset: no clipping.
  std::optional<double> max_grad_norm = std::nullopt;
  double grad_norm_type = 2.0;
  /// Sum the gradients reproducibly (DDPOptions::reproducible, docs/reproducibility.md): each
  /// backward's gradients join a binned sum per element as it ends, and step() reduce-scatters
  /// those sums as integers, so this rank's slice holds the mean over every rank's micro-batches
  /// of the step with the same bits at any number of ranks; max_grad_norm's norm is summed
  /// exactly. The parameters must be whole (no tensor, expert or pipeline cuts).
  bool reproducible = false;
};

class ZeroRedundancyOptimizer : public Joinable {
 public:
  /// params: the replica's parameters (one floating dtype and device). Collective over the
  /// group: every rank must pass the same list (shapes and dtypes in the same order) holding
  /// the same values (the replicas must already be equal, e.g. after
  /// parallel::broadcast_parameters); otherwise every rank raises, naming the first parameter that
  /// differs.
  ZeroRedundancyOptimizer(std::vector<Tensor> params, const OptimizerFactory& make_optimizer,
                          const std::optional<dist::Group>& group = std::nullopt,
                          ZeroOptions options = {});
  /// The parameters of `groups` (whole ones, each in one group; the flat order is the groups'
  /// order), with each element of this rank's slice stepped under its parameter's group
  /// (optim::weight_decay_groups(model, wd): no decay on biases, norms and embeddings).
  ZeroRedundancyOptimizer(const std::vector<optim::ParamGroup>& groups,
                          const GroupedOptimizerFactory& make_optimizer,
                          const std::optional<dist::Group>& group = std::nullopt,
                          ZeroOptions options = {});
  ~ZeroRedundancyOptimizer();
  ZeroRedundancyOptimizer(const ZeroRedundancyOptimizer&) = delete;
  ZeroRedundancyOptimizer& operator=(const ZeroRedundancyOptimizer&) = delete;
  /// Averages the gradients (reduce-scatter), steps this rank's slice, gathers the parameters.
  /// A parameter without a gradient takes part with zeros. The parameters live in one flat
  /// buffer (from construction on) and this rank's slice of it is what the optimizer steps, so
  /// a checkpoint loaded into the model reaches the slice, and loading the model and
  /// shard_optimizer()'s state resumes exactly.
  /// Returns false, on every rank alike, when check_finite skipped the step. Collective.
  bool step();
  /// With set_to_none = false the gradients stay slices of the flat gradient buffer (zeroed);
  /// with true they are dropped and copied into it at the next step.
  void zero_grad(bool set_to_none = true);
  /// The optimizer of this rank's slice (for schedules: set_lr; for sharded checkpoints: the
  /// TrainingState's optimizer).
  optim::Optimizer& shard_optimizer() { return *optimizer_; }
  /// Elements of the flattened parameters this rank owns: ceil(total / group size).
  int64_t shard_numel() const { return shard_.numel(); }
  const dist::Group& group() const { return group_; }
  /// With max_grad_norm: the norm of the averaged gradients in the last step, before clipping.
  double last_grad_norm() const { return last_grad_norm_; }

 private:
  // join(): a rank out of inputs steps with no gradients (each takes part with zeros).
  const dist::Group& join_group() const override { return group_; }
  void shadow_join_step() override;
  // `groups` cut to this rank's slice of the flat parameters.
  std::vector<optim::ParamGroup> slice_groups(const std::vector<optim::ParamGroup>& groups) const;
  std::vector<Tensor> params_;
  dist::Group group_;
  ZeroOptions options_;
  // The parameters' memory, padded to a multiple of the group size, and their gradients'.
  std::unique_ptr<detail::FlatBuffer> flat_params_, flat_grads_;
  Tensor shard_;       // this rank's slice of flat_params_, the leaf its optimizer updates
  Tensor shard_grad_;  // the reduce-scatter's output, shard_'s gradient
  double last_grad_norm_ = 0;
  std::unique_ptr<optim::Optimizer> optimizer_;
  std::unique_ptr<detail::ReproducibleGradients> reproducible_;  // options_.reproducible
  int64_t steps_ = 0;
};

}  // namespace weave::parallel

#pragma once
// Horovod's and Lux's DistributedOptimizer: wraps an optimizer so that step() first averages
// every parameter's gradient over the group, fused into few all_reduces, then steps.
#include <memory>
#include <optional>
#include <vector>

#include "weave/distributed/distributed.h"
#include "weave/optim/optimizer.h"
#include "weave/parallel/core/joinable.h"
#include "weave/parallel/core/replicas.h"

namespace weave::parallel {

namespace detail {
class ReproducibleGradients;
}

struct DistributedOptimizerOptions {
  /// Gradients are packed into flat buffers of at most this size (per dtype and device), each
  /// averaged by one asynchronous all_reduce; the buffers overlap one another.
  double bucket_mb = 25.0;
  /// Communicate in kBFloat16 or kFloat16 (averaged, then widened back).
  std::optional<DType> compress = std::nullopt;
  std::optional<dist::Group> group = std::nullopt;
  /// After averaging, skip the step when a gradient holds NaN or infinity. The averaged
  /// gradients are equal on every rank, so every rank skips alike, without communicating.
  bool check_finite = false;
  /// Sum the gradients reproducibly (DDPOptions::reproducible, docs/reproducibility.md): each
  /// backward's gradients join a binned sum per element as it ends, and step() adds those sums
  /// over the group as integers: the mean over every rank's micro-batches of the step, with the
  /// same bits at any number of ranks. The parameters must be whole.
  bool reproducible = false;
};

class DistributedOptimizer : public Joinable {
 public:
  /// Every rank of the group wraps the optimizer of its replica: the same parameters (shapes
  /// and dtypes) in the same order, or every rank raises naming the first difference.
  /// Collective.
  explicit DistributedOptimizer(optim::Optimizer& optimizer,
                                DistributedOptimizerOptions options = {});
  /// Averages the gradients over the group, then steps the wrapped optimizer. A parameter
  /// without a gradient takes part with zeros (and receives the average). Returns false, on
  /// every rank alike, when check_finite skipped the step.
  bool step();
  /// Averages the gradients only (what step() does before stepping). The gradients become
  /// slices of flat bucket buffers at the first call and stay there (zero_grad(false) keeps
  /// them), so later steps communicate them in place; a gradient that arrives elsewhere (after
  /// zero_grad(true)) is copied in.
  void average_gradients();
  void zero_grad(bool set_to_none = true) { optimizer_.zero_grad(set_to_none); }
  optim::Optimizer& optimizer() { return optimizer_; }
  const dist::Group& group() const { return group_; }

 private:
  // join(): a rank out of inputs steps with no gradients (each takes part with zeros).
  const dist::Group& join_group() const override { return group_; }
  void shadow_join_step() override;
  optim::Optimizer& optimizer_;
  DistributedOptimizerOptions options_;
  dist::Group group_;
  int64_t steps_ = 0;
  struct Buckets;
  std::shared_ptr<Buckets> buckets_;  // built at the first average_gradients
  std::shared_ptr<detail::ReproducibleGradients> reproducible_;  // options_.reproducible
};

}  // namespace weave::parallel

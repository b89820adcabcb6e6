// ZeRO-1: reduce-scatter the gradients, step the owned slice, all-gather the parameters.
#include "weave/parallel/data_parallel/zero.h"

#include <fmt/format.h>
#include <algorithm>

#include <unordered_set>

#include "weave/autograd/grad_mode.h"
#include "weave/parallel/core/agree.h"
#include "weave/parallel/core/flat_buffer.h"
#include "weave/parallel/core/mesh.h"
#include "weave/parallel/core/placement.h"
#include "weave/parallel/core/reproducible.h"
#include "weave/tensor/tensor_impl.h"

namespace weave::parallel {

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<Tensor> params,
                                                 const OptimizerFactory& make_optimizer,
                                                 const std::optional<dist::Group>& group,
                                                 ZeroOptions options)
    : params_(std::move(params)),
      group_(detail::data_parallel_group(group, "ZeroRedundancyOptimizer")),
      options_(options) {
  const char* op = "ZeroRedundancyOptimizer";
  WEAVE_CHECK(!params_.empty(), op, "expected parameters, found none");
  WEAVE_CHECK(group_.rank() >= 0, op, "rank {} is not in group {}", dist::rank(), group_.str());
  for (const Tensor& p : params_) {
    WEAVE_CHECK(p.defined() && p.is_leaf() && p.requires_grad(), op,
                "every parameter must be a leaf that requires grad");
    WEAVE_CHECK(p.dtype() == params_[0].dtype() && p.device() == params_[0].device(), op,
                "parameters must share one dtype and device, found {} on {} and {} on {}; hint: "
                "one ZeroRedundancyOptimizer per dtype",
                params_[0].dtype(), params_[0].device(), p.dtype(), p.device());
  }
  detail::check_replicated({}, params_, group_, op, detail::kTrainExpertsHint);
  // Each rank owns a slice of the flattened list: a list in another order (same total size)
  // would update the wrong elements without a word, and unequal replicas would stay unequal.
  detail::check_same_lines(detail::describe_tensors(params_), group_, op, "the parameters",
                           "pass the same parameters in the same order on every rank");
  detail::check_same_lines(detail::describe_values(params_), group_, op, "the parameters' values",
                           "the values differ: the replicas must be equal before sharding "
                           "(parallel::broadcast_parameters(module) broadcasts rank 0's)");
  NoGradGuard no_grad;
  const int64_t n = group_.size();
  // The parameters and their gradients become slices of two flat buffers padded to a multiple
  // of the group size: the reduce-scatter reads the gradients in place, the optimizer updates
  // this rank's slice of the parameters in place, and the all-gather writes them in place.
  flat_params_ = std::make_unique<detail::FlatBuffer>(detail::FlatBuffer::adopt(params_, n));
  flat_grads_ = std::make_unique<detail::FlatBuffer>(detail::FlatBuffer::like(params_, n));
  const int64_t per_rank = flat_params_->flat.numel() / n;
  shard_ = flat_params_->flat.narrow(0, group_.rank() * per_rank, per_rank).detach();
  shard_.requires_grad_(true);
  shard_grad_ = empty({per_rank}, {.dtype = shard_.dtype(), .device = shard_.device()});
  optimizer_ = make_optimizer({shard_});
  WEAVE_CHECK(optimizer_ != nullptr, op, "the optimizer factory returned null");
  // Sharded checkpoints describe the shard's optimizer state by the parameters it covers.
  auto layout =
      std::make_shared<detail::FlatShard>(detail::FlatShard{.members = {},
                                                            .names = {},
                                                            .splits = {},
                                                            .offsets = flat_params_->offsets,
                                                            .shapes = flat_params_->shapes,
                                                            .begin = group_.rank() * per_rank});
  for (const Tensor& p : params_) layout->members.push_back(p.impl());
  add_cut(shard_, {.kind = Cut::Kind::FlatShard, .group = group_, .layout = std::move(layout)},
          "a ZeRO-1 slice's gradient exists only inside zero.step(): clip with "
          "ZeroOptions::max_grad_norm, which clips the averaged gradients there");
  if (options_.reproducible) {
    std::vector<std::string> names;
    for (size_t k = 0; k < params_.size(); ++k) names.push_back(fmt::format("parameter {}", k));
    detail::check_reproducible(names, params_, group_, op);
    reproducible_ = std::make_unique<detail::ReproducibleGradients>(params_, op, n);
    mark_reproducible(shard_);
  }
}

namespace {

// The groups' parameters in order, each once and whole.
std::vector<Tensor> params_of(const std::vector<optim::ParamGroup>& groups) {
  std::vector<Tensor> params;
  std::unordered_set<const TensorImpl*> seen;
  for (size_t g = 0; g < groups.size(); ++g) {
    WEAVE_CHECK(groups[g].ranges.empty(), "ZeroRedundancyOptimizer",
                "group {} lists element ranges; hint: give whole parameters", g);
    for (const Tensor& p : groups[g].params) {
      WEAVE_CHECK(!p.defined() || seen.insert(p.impl()).second, "ZeroRedundancyOptimizer",
                  "a parameter {} is listed twice; hint: each parameter belongs to one group",
                  p.shape());
      params.push_back(p);
    }
  }
  return params;
}

}  // namespace

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(const std::vector<optim::ParamGroup>& groups,
                                                 const GroupedOptimizerFactory& make_optimizer,
                                                 const std::optional<dist::Group>& group,
                                                 ZeroOptions options)
    // The factory runs once the flat buffer exists, which slice_groups reads.
    : ZeroRedundancyOptimizer(
          params_of(groups),
          [this, &groups, &make_optimizer](std::vector<Tensor>) {
            return make_optimizer(slice_groups(groups));
          },
          group, options) {}

std::vector<optim::ParamGroup> ZeroRedundancyOptimizer::slice_groups(
    const std::vector<optim::ParamGroup>& groups) const {
  std::vector<optim::ParamGroup> out(groups.size());
  std::vector<int> member_groups;  // params_ is the groups' parameters in order
  for (size_t g = 0; g < groups.size(); ++g) {
    out[g].weight_decay = groups[g].weight_decay;
    member_groups.insert(member_groups.end(), groups[g].params.size(), int(g));
  }
  flat_params_->add_shard_to_groups(out, shard_, group_.rank() * shard_.numel(), member_groups);
  return out;
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() {
  detail::remove_cut(shard_, Cut::Kind::FlatShard);
}

bool ZeroRedundancyOptimizer::step() {
  detail::join_step_begins(this);
  dist::set_step(group_, steps_++);
  NoGradGuard no_grad;
  for (size_t k = 0; k < params_.size(); ++k) {
    // A parameter whose memory was replaced since (by code that rebinds rather than copies)
    // comes back into the flat buffer, its values with it.
    if (params_[k].storage() != flat_params_->flat.storage())
      detail::bind_data(params_[k], flat_params_->view(k));
    detail::bind_grad(params_[k], flat_grads_->view(k));
  }
  if (reproducible_) {
    const int64_t microbatches = reproducible_->agree(group_).microbatches;
    reproducible_->reduce_scatter_into(shard_grad_, group_, microbatches);
    shard_.set_grad(shard_grad_);
    if (options_.check_finite && dist::agree_max({all_finite(shard_grad_) ? 0 : 1}, group_)[0] != 0)
      return false;
  } else if (!options_.check_finite) {
    dist::reduce_scatter(shard_grad_, flat_grads_->flat, dist::ReduceOp::Avg, group_);
    shard_.set_grad(shard_grad_);
  } else {
    // Every rank's slice of the reduce-scatter gets one more element: this rank's "my
    // gradients are not finite" (0 or 1); the average says whether any rank's were.
    const bool finite = all_finite(flat_grads_->flat);
    const int64_t n = group_.size(), per_rank = shard_.numel();
    Tensor packed = empty({n, per_rank + 1}, {.dtype = shard_.dtype(), .device = shard_.device()});
    packed.narrow(1, 0, per_rank).copy_(flat_grads_->flat.reshape({n, per_rank}));
    packed.narrow(1, per_rank, 1).fill_(finite ? 0.0 : 1.0);
    Tensor mine = empty({per_rank + 1}, {.dtype = shard_.dtype(), .device = shard_.device()});
    dist::reduce_scatter(mine, packed.reshape({-1}), dist::ReduceOp::Avg, group_);
    if (mine.narrow(0, per_rank, 1).to(kFloat64).item<double>() != 0) return false;
    shard_.set_grad(mine.narrow(0, 0, per_rank));
  }
  if (options_.max_grad_norm)  // the shard's placement says who else holds it (padding is zero)
    last_grad_norm_ = parallel::clip_grad_norm_({shard_}, *options_.max_grad_norm,
                                                options_.grad_norm_type, group_);
  optimizer_->step();  // updates shard_, this rank's slice of the parameters, in place
  dist::all_gather(flat_params_->flat, shard_.detach(), group_);
  return true;
}

void ZeroRedundancyOptimizer::shadow_join_step() {
  zero_grad(/*set_to_none=*/true);
  step();
}

void ZeroRedundancyOptimizer::zero_grad(bool set_to_none) {
  optim::zero_grad(params_, set_to_none);
}

}  // namespace weave::parallel

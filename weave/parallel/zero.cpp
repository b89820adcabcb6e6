// ZeRO-1: reduce-scatter the gradients, step the owned slice, all-gather the parameters.
#include "weave/parallel/zero.h"

#include <algorithm>

#include "weave/autograd/grad_mode.h"
#include "weave/parallel/agree.h"
#include "weave/parallel/join.h"
#include "weave/parallel/mesh.h"

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
    total_ += p.numel();
  }
  // Each rank owns a slice of the flattened list: a list in another order (same total size)
  // would update the wrong elements without a word, and unequal replicas would stay unequal.
  detail::check_same_lines(detail::describe_tensors(params_), group_, op, "the parameters",
                           "pass the same parameters in the same order on every rank");
  detail::check_same_lines(detail::describe_values(params_), group_, op, "the parameters' values",
                           "the values differ: the replicas must be equal before sharding "
                           "(parallel::synchronize(module) broadcasts rank 0's)");
  NoGradGuard no_grad;
  const int64_t n = group_.size(), per_rank = (total_ + n - 1) / n;
  std::vector<Tensor> pieces;
  for (const Tensor& p : params_) pieces.push_back(p.reshape({-1}));
  if (per_rank * n > total_)
    pieces.push_back(zeros({per_rank * n - total_},
                           {.dtype = params_[0].dtype(), .device = params_[0].device()}));
  flat_params_ = cat(pieces);
  shard_ = flat_params_.narrow(0, group_.rank() * per_rank, per_rank).detach();
  shard_.requires_grad_(true);
  for (const Tensor& p : params_) synced_versions_.push_back(p.version());
  optimizer_ = make_optimizer({shard_});
  WEAVE_CHECK(optimizer_ != nullptr, op, "the optimizer factory returned null");
}

bool ZeroRedundancyOptimizer::step() {
  detail::join_step_begins(this);
  dist::set_step(group_, steps_++);
  NoGradGuard no_grad;
  // The parameters are the truth: a parameter changed since the last step (a loaded checkpoint,
  // an in-place edit: its version moved) reaches the owned slice before the optimizer updates it.
  const int64_t start = group_.rank() * shard_.numel(), stop = start + shard_.numel();
  int64_t offset = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    const int64_t lo = std::max(start, offset), hi = std::min(stop, offset + p.numel());
    if (lo < hi && p.version() != synced_versions_[i])
      shard_.narrow(0, lo - start, hi - lo).copy_(p.reshape({-1}).narrow(0, lo - offset, hi - lo));
    offset += p.numel();
  }
  std::vector<Tensor> grads;
  for (const Tensor& p : params_)
    grads.push_back(p.grad().defined()
                        ? p.grad().reshape({-1})
                        : zeros({p.numel()}, {.dtype = p.dtype(), .device = p.device()}));
  const int64_t padding = flat_params_.numel() - total_;
  if (padding > 0)
    grads.push_back(
        zeros({padding}, {.dtype = flat_params_.dtype(), .device = flat_params_.device()}));
  Tensor shard_grad = empty({shard_.numel()}, {.dtype = shard_.dtype(), .device = shard_.device()});
  if (!options_.check_finite) {
    dist::reduce_scatter(shard_grad, cat(grads), dist::ReduceOp::Avg, group_);
  } else {
    // Every rank's slice of the reduce-scatter gets one more element: this rank's "my
    // gradients are not finite" (0 or 1); the average says whether any rank's were.
    bool finite = true;
    for (const Tensor& g : grads) finite = finite && all_finite(g);
    const int64_t n = group_.size(), per_rank = shard_.numel();
    Tensor packed = empty({n, per_rank + 1}, {.dtype = shard_.dtype(), .device = shard_.device()});
    packed.narrow(1, 0, per_rank).copy_(cat(grads).reshape({n, per_rank}));
    packed.narrow(1, per_rank, 1).fill_(finite ? 0.0 : 1.0);
    Tensor mine = empty({per_rank + 1}, {.dtype = shard_.dtype(), .device = shard_.device()});
    dist::reduce_scatter(mine, packed.reshape({-1}), dist::ReduceOp::Avg, group_);
    if (mine.narrow(0, per_rank, 1).to(kFloat64).item<double>() != 0) return false;
    shard_grad = mine.narrow(0, 0, per_rank);
  }
  shard_.set_grad(shard_grad);
  optimizer_->step();  // updates shard_, a slice of flat_params_, in place
  Tensor gathered =
      empty(flat_params_.shape(), {.dtype = shard_.dtype(), .device = shard_.device()});
  dist::all_gather(gathered, shard_.detach(), group_);
  flat_params_.copy_(gathered);
  offset = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor& p = params_[i];
    p.copy_(flat_params_.narrow(0, offset, p.numel()).reshape(p.shape()));
    synced_versions_[i] = p.version();
    offset += p.numel();
  }
  return true;
}

void ZeroRedundancyOptimizer::zero_grad(bool set_to_none) {
  optim::zero_grad(params_, set_to_none);
}

}  // namespace weave::parallel

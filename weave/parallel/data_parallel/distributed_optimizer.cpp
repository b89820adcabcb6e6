// Gradient averaging fused into flat buckets, and the optimizer wrapper built on it.
#include "weave/parallel/data_parallel/distributed_optimizer.h"

#include <fmt/format.h>

#include <algorithm>

#include "weave/autograd/grad_mode.h"
#include "weave/parallel/core/agree.h"
#include "weave/parallel/core/flat_buffer.h"
#include "weave/parallel/core/mesh.h"
#include "weave/parallel/core/placement.h"
#include "weave/parallel/core/readiness.h"
#include "weave/parallel/core/reproducible.h"

namespace weave::parallel {

DistributedOptimizer::DistributedOptimizer(optim::Optimizer& optimizer,
                                           DistributedOptimizerOptions options)
    : optimizer_(optimizer),
      options_(std::move(options)),
      group_(detail::data_parallel_group(options_.group, "DistributedOptimizer")) {
  WEAVE_CHECK(group_.rank() >= 0, "DistributedOptimizer", "rank {} is not in group {}",
              dist::rank(), group_.str());
  detail::check_bucket_sizes("DistributedOptimizer", options_.bucket_mb, options_.bucket_mb);
  detail::check_replicated({}, optimizer_.params(), group_, "DistributedOptimizer",
                           detail::kTrainExpertsHint);
  detail::check_same_lines(detail::describe_tensors(optimizer_.params()), group_,
                           "DistributedOptimizer", "the parameters",
                           "wrap the same parameters in the same order on every rank");
  if (!options_.reproducible) return;
  WEAVE_CHECK(!options_.compress, "DistributedOptimizer",
              "reproducible mode sums the gradients in integers; compress {} would round them "
              "first; hint: leave compress unset",
              *options_.compress);
  std::vector<Tensor> params;
  std::vector<std::string> names;
  for (const Tensor& p : optimizer_.params())
    if (p.defined() && p.requires_grad()) {
      names.push_back(fmt::format("parameter {}", params.size()));
      params.push_back(p);
    }
  detail::check_reproducible(names, params, group_, "DistributedOptimizer");
  reproducible_ = std::make_shared<detail::ReproducibleGradients>(params, "DistributedOptimizer");
}

struct DistributedOptimizer::Buckets {
  std::vector<Tensor> params;
  std::vector<Tensor> views;  // params[i]'s gradient inside its bucket
  std::vector<detail::GradBucket> buckets;
};

void DistributedOptimizer::average_gradients() {
  NoGradGuard no_grad;
  std::vector<Tensor> params;
  for (const Tensor& p : optimizer_.params())
    if (p.defined() && p.requires_grad()) params.push_back(p);
  const auto same_params = [&] {
    return buckets_ && std::equal(params.begin(), params.end(), buckets_->params.begin(),
                                  buckets_->params.end(),
                                  [](const Tensor& a, const Tensor& b) { return a.is_same(b); });
  };
  WEAVE_CHECK(!reproducible_ || !buckets_ || same_params(), "DistributedOptimizer",
              "the optimizer's parameters changed since construction, and reproducible mode sums "
              "the ones it was built with; hint: build a new DistributedOptimizer");
  if (!same_params()) {  // first call, or the optimizer's parameter list changed
    buckets_ = std::make_shared<Buckets>();
    buckets_->params = params;
    std::vector<int> order(params.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = int(i);
    buckets_->views.resize(params.size());
    for (const std::vector<int>& members :
         detail::cut_buckets(order, params, options_.bucket_mb, options_.bucket_mb)) {
      std::vector<Tensor> bucket_params;
      for (int i : members) bucket_params.push_back(params[size_t(i)]);
      buckets_->buckets.push_back(detail::GradBucket::allocate(bucket_params, options_.compress));
      for (size_t k = 0; k < members.size(); ++k)
        buckets_->views[size_t(members[k])] = buckets_->buckets.back().grads.view(k);
    }
  }
  for (size_t i = 0; i < params.size(); ++i) detail::bind_grad(params[i], buckets_->views[i]);
  if (reproducible_) {  // the micro-batches' sums, added over the group as integers
    const int64_t microbatches = reproducible_->agree(group_).microbatches;
    return reproducible_->reduce_into(buckets_->views, group_, microbatches);
  }
  for (detail::GradBucket& b : buckets_->buckets) b.launch_average(group_);
  for (detail::GradBucket& b : buckets_->buckets) b.wait();
}

bool DistributedOptimizer::step() {
  detail::join_step_begins(this);
  dist::set_step(group_, steps_++);
  average_gradients();
  if (options_.check_finite) {
    std::vector<Tensor> grads;
    for (const Tensor& p : optimizer_.params()) grads.push_back(p.grad());
    if (!all_finite(grads)) return false;
  }
  optimizer_.step();
  return true;
}

void DistributedOptimizer::shadow_join_step() {
  zero_grad(/*set_to_none=*/true);
  step();
}

}  // namespace weave::parallel

// Gradient averaging fused into flat buckets, and the optimizer wrapper built on it.
#include "weave/parallel/distributed_optimizer.h"

#include <algorithm>

#include "weave/autograd/grad_mode.h"
#include "weave/parallel/agree.h"
#include "weave/parallel/flat_buffer.h"
#include "weave/parallel/join.h"
#include "weave/parallel/mesh.h"

namespace weave::parallel {

void average_gradients(const std::vector<Tensor>& params, const dist::Group& group,
                       double bucket_mb, std::optional<DType> compress) {
  NoGradGuard no_grad;
  std::vector<Tensor> grads;
  for (const Tensor& p : params) {
    if (!p.defined() || !p.requires_grad()) continue;
    if (!p.grad().defined()) p.set_grad(zeros_like(p));
    grads.push_back(p.grad());
  }
  average_tensors(grads, group, bucket_mb, compress);
}

void average_tensors(const std::vector<Tensor>& tensors, const dist::Group& group, double bucket_mb,
                     std::optional<DType> compress) {
  WEAVE_CHECK(bucket_mb > 0, "average_tensors", "bucket_mb must be positive, found {}", bucket_mb);
  NoGradGuard no_grad;
  // Consecutive tensors of one dtype and device share a bucket up to the size cap.
  struct Bucket {
    std::vector<Tensor> members;
    Tensor flat, wire;
    dist::Work work;
  };
  std::vector<Bucket> buckets;
  const double cap = bucket_mb * 1024 * 1024;
  double bytes = 0;
  for (const Tensor& g : tensors) {
    const double size = double(g.numel()) * double(g.itemsize());
    if (buckets.empty() || buckets.back().members.front().dtype() != g.dtype() ||
        buckets.back().members.front().device() != g.device() || bytes + size > cap) {
      buckets.emplace_back();
      bytes = 0;
    }
    buckets.back().members.push_back(g);
    bytes += size;
  }
  for (Bucket& b : buckets) {  // pack and launch every bucket before waiting for any
    std::vector<Tensor> pieces;
    for (const Tensor& g : b.members) pieces.push_back(g.reshape({-1}));
    b.flat = cat(pieces);
    b.wire = compress && *compress != b.flat.dtype() ? b.flat.to(*compress) : b.flat;
    b.work = dist::all_reduce(b.wire, dist::ReduceOp::Avg, group, /*async_op=*/true);
  }
  for (Bucket& b : buckets) {
    b.work.wait();
    if (!b.wire.is_same(b.flat)) b.flat.copy_(b.wire);
    int64_t offset = 0;
    for (Tensor& g : b.members) {
      g.copy_(b.flat.narrow(0, offset, g.numel()).reshape(g.shape()));
      offset += g.numel();
    }
  }
}

void broadcast_optimizer_state(optim::Optimizer& optimizer, int root,
                               const std::optional<dist::Group>& group_option) {
  const dist::Group group = detail::data_parallel_group(group_option, "broadcast_optimizer_state");
  NoGradGuard no_grad;
  std::vector<Tensor> state = optimizer.state();
  // Same number of state tensors everywhere, or the broadcasts below would not pair up.
  Tensor counts = full({2}, double(state.size()), {.dtype = kInt64});
  counts.narrow(0, 1, 1).mul_(-1.0);  // max of n and max of -n: equal iff all n agree
  dist::all_reduce(counts, dist::ReduceOp::Max, group);
  auto c = counts.to_vector<int64_t>();
  WEAVE_CHECK(c[0] == -c[1], "broadcast_optimizer_state",
              "ranks hold different optimizer states ({} to {} state tensors); hint: broadcast "
              "before the first step, or after the same number of steps everywhere",
              -c[1], c[0]);
  for (const Tensor& t : state) dist::broadcast(t, root, group);
  Tensor lr = full({1}, optimizer.lr(), {.dtype = kFloat64});
  dist::broadcast(lr, root, group);
  optimizer.set_lr(lr.item<double>());
}

DistributedOptimizer::DistributedOptimizer(optim::Optimizer& optimizer,
                                           DistributedOptimizerOptions options)
    : optimizer_(optimizer),
      options_(std::move(options)),
      group_(detail::data_parallel_group(options_.group, "DistributedOptimizer")) {
  WEAVE_CHECK(group_.rank() >= 0, "DistributedOptimizer", "rank {} is not in group {}",
              dist::rank(), group_.str());
  detail::check_bucket_sizes("DistributedOptimizer", options_.bucket_mb, options_.bucket_mb);
  detail::check_same_lines(detail::describe_tensors(optimizer_.params()), group_,
                           "DistributedOptimizer", "the parameters",
                           "wrap the same parameters in the same order on every rank");
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

}  // namespace weave::parallel

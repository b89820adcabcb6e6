// Gradient averaging fused into flat buckets, and the optimizer wrapper built on it.
#include "weave/parallel/distributed_optimizer.h"

#include "weave/autograd/grad_mode.h"
#include "weave/parallel/agree.h"
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

void synchronize(optim::Optimizer& optimizer, int root,
                 const std::optional<dist::Group>& group_option) {
  const dist::Group group = detail::data_parallel_group(group_option, "synchronize");
  NoGradGuard no_grad;
  std::vector<Tensor> state = optimizer.state();
  // Same number of state tensors everywhere, or the broadcasts below would not pair up.
  Tensor counts = full({2}, double(state.size()), {.dtype = kInt64});
  counts.narrow(0, 1, 1).mul_(-1.0);  // max of n and max of -n: equal iff all n agree
  dist::all_reduce(counts, dist::ReduceOp::Max, group);
  auto c = counts.to_vector<int64_t>();
  WEAVE_CHECK(c[0] == -c[1], "synchronize",
              "ranks hold different optimizer states ({} to {} state tensors); hint: synchronize "
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
  detail::check_same_lines(detail::describe_tensors(optimizer_.params()), group_,
                           "DistributedOptimizer", "the parameters",
                           "wrap the same parameters in the same order on every rank");
}

void DistributedOptimizer::synchronize() {
  average_gradients(optimizer_.params(), group_, options_.bucket_mb, options_.compress);
}

bool DistributedOptimizer::step() {
  detail::join_step_begins(this);
  dist::set_step(group_, steps_++);
  synchronize();
  if (options_.check_finite) {
    std::vector<Tensor> grads;
    for (const Tensor& p : optimizer_.params()) grads.push_back(p.grad());
    if (!all_finite(grads)) return false;
  }
  optimizer_.step();
  return true;
}

}  // namespace weave::parallel

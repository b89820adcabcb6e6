// Flat buffers, bound parameters and gradients, per-backward readiness, and the bucket order.
#include "weave/parallel/flat_buffer.h"
#include "weave/parallel/no_sync.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/ops/ops.h"
#include "weave/tensor/tensor_impl.h"

namespace weave::parallel::detail {

FlatBuffer FlatBuffer::like(const std::vector<Tensor>& tensors, int64_t pad_to, int64_t extra) {
  FlatBuffer buffer;
  for (const Tensor& t : tensors) {
    buffer.shapes.push_back(t.shape());
    buffer.offsets.push_back(buffer.used);
    buffer.used += t.numel();
  }
  const int64_t padded = (buffer.used + pad_to - 1) / pad_to * pad_to;
  buffer.flat =
      zeros({padded + extra}, {.dtype = tensors[0].dtype(), .device = tensors[0].device()});
  return buffer;
}

FlatBuffer FlatBuffer::adopt(const std::vector<Tensor>& tensors, int64_t pad_to) {
  FlatBuffer buffer = like(tensors, pad_to);
  for (size_t k = 0; k < tensors.size(); ++k) bind_data(tensors[k], buffer.view(k));
  return buffer;
}

Tensor FlatBuffer::view_in(const Tensor& buffer, size_t k) const {
  return make_view(buffer, shapes[k], contiguous_strides(shapes[k]), buffer.offset() + offsets[k]);
}

GradBucket GradBucket::allocate(const std::vector<Tensor>& params, std::optional<DType> compress,
                                int64_t extra) {
  GradBucket bucket;
  bucket.grads = FlatBuffer::like(params, 1, extra);
  const Tensor& flat = bucket.grads.flat;
  bucket.wire = compress && *compress != flat.dtype()
                    ? empty(flat.shape(), {.dtype = *compress, .device = flat.device()})
                    : flat;
  return bucket;
}

void GradBucket::launch_average(const dist::Group& group) {
  if (!wire.is_same(grads.flat)) wire.copy_(grads.flat);
  work = dist::all_reduce(wire, dist::ReduceOp::Avg, group, /*async_op=*/true);
}

void GradBucket::wait() {
  work.wait();
  if (!wire.is_same(grads.flat)) grads.flat.copy_(wire);
}

void bind_data(const Tensor& tensor, Tensor view) {
  WEAVE_CHECK(tensor.shape() == view.shape() && tensor.dtype() == view.dtype(), "bind_data",
              "expected a view of shape {} and dtype {}, found {} and {}", tensor.shape(),
              tensor.dtype(), view.shape(), view.dtype());
  {
    NoGradGuard no_grad;
    view.copy_(tensor.detach());
  }
  TensorImpl& impl = *tensor.impl();
  impl.storage = view.storage();
  impl.strides = view.strides();
  impl.offset = view.offset();
}

void bind_grad(const Tensor& param, Tensor view) {
  Tensor grad = param.grad();
  if (grad.defined() && grad.storage() == view.storage() && grad.offset() == view.offset()) return;
  NoGradGuard no_grad;
  if (grad.defined())
    view.copy_(grad);
  else
    view.zero_();
  param.set_grad(view);
}

// ---- readiness -------------------------------------------------------------------------------

GradReadiness::GradReadiness(size_t params, Handlers handlers)
    : handlers_(std::move(handlers)), bucket_of_(params, -1), ready_(params, 0) {}

std::shared_ptr<GradReadiness> GradReadiness::create(const std::vector<Tensor>& params,
                                                     Handlers handlers) {
  std::shared_ptr<GradReadiness> readiness(new GradReadiness(params.size(), std::move(handlers)));
  std::weak_ptr<GradReadiness> weak = readiness;
  for (size_t i = 0; i < params.size(); ++i)
    readiness->hooks_.push_back(params[i].register_post_accumulate_grad_hook([weak, i](Tensor&) {
      if (auto alive = weak.lock()) alive->on_hook(int(i), weak);
    }));
  return readiness;
}

GradReadiness::~GradReadiness() {
  for (HookHandle& hook : hooks_) hook.remove();
}

void GradReadiness::set_buckets(std::vector<std::vector<int>> buckets, int held_back) {
  buckets_ = std::move(buckets);
  held_back_ = held_back;
  std::fill(bucket_of_.begin(), bucket_of_.end(), -1);
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (int i : buckets_[b]) bucket_of_[size_t(i)] = int(b);
  // What is ready already (the traced backward's parameters) stays ready, and counts down.
  pending_.assign(buckets_.size(), 0);
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (int i : buckets_[b]) pending_[b] += ready_[size_t(i)] ? 0 : 1;
  next_launch_ = 0;
}

std::vector<int> GradReadiness::take_trace() {
  return std::exchange(trace_, {});
}

void GradReadiness::clear() {
  std::fill(ready_.begin(), ready_.end(), 0);
  ready_count_ = 0;
  ready_at_first_launch_ = -1;
  next_launch_ = 0;
  for (size_t b = 0; b < buckets_.size(); ++b) pending_[b] = int(buckets_[b].size());
}

void GradReadiness::on_hook(int param, const std::weak_ptr<GradReadiness>& self) {
  if (paused_) return;
  if (!in_backward_) {
    in_backward_ = true;
    clear();
    // Runs when backward ends, also when an exception unwinds it: every rank settles the step.
    autograd::queue_final_callback([self](bool failed) {
      if (auto alive = self.lock()) {
        alive->in_backward_ = false;
        alive->finish(failed);
      }
    });
  }
  mark_ready(param);
}

void GradReadiness::finish(bool failed) {
  backward_expected_ = false;
  if (handlers_.finish) handlers_.finish(failed);
}

bool GradReadiness::begin_forward(const char* owner, int64_t step) {
  const bool synchronizing = autograd::GradMode::is_enabled() && !paused_;
  // While the pending forward's graph lives, its backward may still come, covering this forward
  // too (two forwards, one backward of the summed losses): nothing was skipped.
  const bool may_come = backward_expected_ && !pending_graph_.expired();
  if (synchronizing && !may_come) settle_skipped_backward(owner, step);
  return synchronizing;
}

void GradReadiness::set_forward_output(const Tensor& output) {
  pending_graph_ = output.defined() ? output.grad_fn() : nullptr;
}

void GradReadiness::settle_skipped_backward(const char* owner, int64_t step) {
  if (backward_expected_) {
    // Once per wrapper: an evaluation loop run in grad mode would otherwise print per batch.
    if (!warned_skipped_backward_)
      std::fprintf(stderr,
                   "[weave] rank %d: %s: step %lld's forward got no backward on this rank; its "
                   "gradients are discarded on every rank (each such step is counted in "
                   "stats().failed_steps; this warning is not repeated); hint: run an evaluation "
                   "pass under NoGradGuard, and a backward that must not synchronize under "
                   "no_sync()\n",
                   dist::rank(), owner, static_cast<long long>(step));
    warned_skipped_backward_ = true;
    clear();
    finish(/*failed=*/true);
  }
}

void GradReadiness::mark_ready(int param) {
  if (ready_[size_t(param)]) return;
  ready_[size_t(param)] = 1;
  ++ready_count_;
  if (buckets_.empty()) {
    trace_.push_back(param);
    return;
  }
  if (handlers_.ready) handlers_.ready(param);
  const int b = bucket_of_[size_t(param)];
  if (b >= 0 && --pending_[size_t(b)] == 0) launch_ready(buckets_.size() - size_t(held_back_));
}

void GradReadiness::launch_ready(size_t end) {
  while (next_launch_ < end && pending_[next_launch_] == 0) {
    if (ready_at_first_launch_ < 0) ready_at_first_launch_ = ready_count_;
    handlers_.launch(int(next_launch_++));
  }
}

void GradReadiness::launch_rest() {
  std::fill(pending_.begin(), pending_.end(), 0);
  launch_ready(buckets_.size());
}

}  // namespace weave::parallel::detail

namespace weave::parallel {

NoSyncGuard::NoSyncGuard(std::shared_ptr<detail::GradReadiness> readiness)
    : readiness_(std::move(readiness)), previous_(readiness_->paused()) {
  readiness_->set_paused(true);
}

NoSyncGuard::~NoSyncGuard() {
  readiness_->set_paused(previous_);
}

}  // namespace weave::parallel

namespace weave::parallel::detail {

// ---- the bucket order ------------------------------------------------------------------------

std::vector<int> agree_on_order(std::vector<int> trace, size_t parameters, const dist::Group& group,
                                bool& differs_anywhere, std::vector<int64_t>* counts) {
  for (int i = int(parameters) - 1; i >= 0; --i)
    if (std::find(trace.begin(), trace.end(), i) == trace.end()) trace.push_back(i);
  std::vector<int64_t> mine(trace.begin(), trace.end());
  Tensor first = from_vector(mine);
  dist::broadcast(first, 0, group);
  const std::vector<int64_t> adopted = first.to_vector<int64_t>();
  std::vector<int64_t> words = {adopted != mine ? 1 : 0};
  if (counts) words.insert(words.end(), counts->begin(), counts->end());
  Tensor summed = from_vector(words);
  dist::all_reduce(summed, dist::ReduceOp::Sum, group);
  words = summed.to_vector<int64_t>();
  differs_anywhere = words[0] != 0;
  if (counts) counts->assign(words.begin() + 1, words.end());
  return {adopted.begin(), adopted.end()};
}

void FlatBuffer::add_shard_to_groups(std::vector<optim::ParamGroup>& groups, const Tensor& shard,
                                     int64_t first, const std::vector<int>& group_of) const {
  bool listed = false;
  for (size_t k = 0; k < size(); ++k) {
    const int64_t begin = offsets[k], end = begin + shapes[k].numel();
    const int64_t lo = std::max(begin, first), hi = std::min(end, first + shard.numel());
    if (lo >= hi) continue;
    optim::ParamGroup& group = groups[size_t(group_of[k])];
    group.params.push_back(shard);
    group.ranges.push_back({lo - first, hi - first});
    listed = true;
  }
  if (!listed && !groups.empty()) {
    groups[0].params.push_back(shard);
    groups[0].ranges.push_back({0, 0});
  }
}

void check_bucket_sizes(const char* op, double first_mb, double mb) {
  // NaN compares false with everything, so `> 0` refuses it too.
  WEAVE_CHECK(first_mb > 0 && mb > 0, op,
              "bucket sizes must be positive megabytes, found {} MB for the first bucket and {} MB "
              "for the others; hint: bucket_mb defaults to 25",
              first_mb, mb);
}

std::vector<std::vector<int>> cut_buckets(const std::vector<int>& order,
                                          const std::vector<Tensor>& params, double first_mb,
                                          double mb) {
  std::vector<std::vector<int>> buckets;
  double bytes = 0;
  for (int i : order) {
    const Tensor& p = params[i];
    const double size = double(p.numel()) * double(p.itemsize());
    const double cap = (buckets.size() <= 1 ? first_mb : mb) * 1024.0 * 1024.0;
    bool fresh = buckets.empty();
    if (!fresh) {
      const Tensor& first = params[buckets.back().front()];
      fresh = first.dtype() != p.dtype() || first.device() != p.device() || bytes + size > cap;
    }
    if (fresh) {
      buckets.emplace_back();
      bytes = 0;
    }
    buckets.back().push_back(i);
    bytes += size;
  }
  return buckets;
}

}  // namespace weave::parallel::detail

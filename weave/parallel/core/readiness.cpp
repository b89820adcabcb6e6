// Per-backward readiness, the bucket order every rank adopts, and the buckets cut from it.
#include "weave/parallel/core/readiness.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/ops/ops.h"
#include "weave/parallel/core/no_sync.h"
#include "weave/tensor/tensor_impl.h"

namespace weave::parallel::detail {

// ---- readiness -------------------------------------------------------------------------------

GradReadiness::GradReadiness(size_t params, Handlers handlers)
    : handlers_(std::move(handlers)), bucket_of_(params, -1), ready_(params, 0) {}

std::shared_ptr<GradReadiness> GradReadiness::create(const std::vector<Tensor>& params,
                                                     Handlers handlers) {
  std::shared_ptr<GradReadiness> readiness(new GradReadiness(params.size(), std::move(handlers)));
  std::weak_ptr<GradReadiness> weak = readiness;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].requires_grad()) continue;  // frozen (FSDP shards it): never in a bucket
    readiness->hooks_.push_back(params[i].register_post_accumulate_grad_hook([weak, i](Tensor&) {
      if (auto alive = weak.lock()) alive->on_hook(int(i), weak);
    }));
  }
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

namespace weave::parallel {

NoSyncGuard::NoSyncGuard(std::shared_ptr<detail::GradReadiness> readiness)
    : readiness_(std::move(readiness)), previous_(readiness_->paused()) {
  readiness_->set_paused(true);
}

NoSyncGuard::~NoSyncGuard() {
  readiness_->set_paused(previous_);
}

}  // namespace weave::parallel

// DistributedDataParallel: model agreement, broadcast, gradient buckets traced in the first
// backward, per-bucket asynchronous averaging launched from post-accumulate hooks, and the
// end-of-backward wait.
#include "weave/parallel/ddp.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/optim/optimizer.h"
#include "weave/parallel/agree.h"
#include "weave/parallel/buckets.h"
#include "weave/parallel/join.h"
#include "weave/parallel/mesh.h"

namespace weave::parallel {

namespace {

// "parameter name float32 [4, 3]" for every parameter, then every buffer.
std::vector<std::string> describe_model(const nn::Module& module) {
  std::vector<std::string> lines;
  for (const auto& [name, t] : module.named_parameters())
    lines.push_back(fmt::format("parameter {} {} {}", name, t.dtype(), t.shape()));
  for (const auto& [name, t] : module.named_buffers())
    lines.push_back(fmt::format("buffer {} {} {}", name, t.dtype(), t.shape()));
  return lines;
}

}  // namespace

void check_same_model(const nn::Module& module, const std::optional<dist::Group>& group_option) {
  detail::check_same_lines(describe_model(module),
                           detail::data_parallel_group(group_option, "check_same_model"),
                           "DistributedDataParallel", "the model",
                           "build the same model (same layers, shapes and dtypes) on every rank");
}

void synchronize(nn::Module& module, int root, const std::optional<dist::Group>& group_option) {
  const dist::Group group = detail::data_parallel_group(group_option, "synchronize");
  NoGradGuard no_grad;
  for (const Tensor& t : module.parameters())
    if (t.defined()) dist::broadcast(t, root, group);
  for (const Tensor& t : module.buffers())
    if (t.defined()) dist::broadcast(t, root, group);
}

// ---- the reducer -------------------------------------------------------------------------

namespace {
// The status words after the last bucket's gradients: this rank's backward failed (or was
// skipped); this rank has parameters without a gradient.
constexpr int64_t kStatusWords = 2;
enum StatusWord { kFailed = 0, kUnused = 1 };
}  // namespace

struct DistributedDataParallel::State {
  struct Bucket {
    std::vector<int> params;
    Tensor buffer;  // the gradients, flat, in the parameters' dtype (the last: + status words)
    Tensor wire;    // what travels: buffer itself, or its compressed copy
    int pending = 0;
    dist::Work work;
    bool launched = false;
  };

  DDPOptions options;
  dist::Group group;
  std::vector<std::string> names;
  std::vector<Tensor> params;
  std::vector<Tensor> views;  // params[i]'s gradient inside its bucket
  std::vector<int> bucket_of;
  std::vector<Bucket> buckets;
  std::vector<HookHandle> hooks;

  bool traced = false;
  std::vector<int> trace;  // first backward: parameter indices in the order they became ready
  bool no_sync = false;
  bool in_backward = false;
  // A synchronizing forward ran and its backward has not settled yet.
  bool forward_pending = false;
  bool finite = true;
  std::vector<char> ready;
  int64_t ready_count = 0;
  size_t next_launch = 0;
  DDPStats stats;

  explicit State(DDPOptions o)
      : options(std::move(o)),
        group(detail::data_parallel_group(options.group, "DistributedDataParallel")) {}

  // A post-accumulate-grad hook fired for parameter i.
  void on_ready(int i, const std::weak_ptr<State>& self) {
    if (no_sync) return;
    if (!in_backward) {
      begin_step();
      // Runs when backward ends, also when an exception unwinds it: the step is settled on
      // every rank either way.
      autograd::queue_final_callback([self](bool failed) {
        if (auto state = self.lock()) state->settle(failed);
      });
    }
    if (ready[i]) return;
    ready[i] = 1;
    ++ready_count;
    if (!traced) {
      trace.push_back(i);
      return;
    }
    into_bucket(i);
    Bucket& b = buckets[bucket_of[i]];
    if (--b.pending == 0) launch_ready();
  }

  // The per-step state, fresh: nothing ready, nothing launched.
  void begin_step() {
    in_backward = true;
    std::fill(ready.begin(), ready.end(), 0);
    ready_count = 0;
    next_launch = 0;
    for (Bucket& b : buckets) {
      b.pending = int(b.params.size());
      b.launched = false;
    }
    stats.ready_before_first_launch = -1;
  }

  // Makes parameter i's gradient its bucket view (copying it in if it arrived elsewhere, as
  // after zero_grad(set_to_none = true)).
  void into_bucket(int i) {
    Tensor& view = views[i];
    Tensor grad = params[i].grad();
    if (grad.defined() && grad.storage() == view.storage() && grad.offset() == view.offset())
      return;
    if (grad.defined())
      view.copy_(grad);
    else
      view.zero_();
    params[i].set_grad(view);
  }

  // Launches, in bucket order, every bucket whose gradients are all in (order matters: every
  // rank must issue the same all_reduces in the same order). The last bucket, which carries the
  // status words, waits for the end of backward, when this rank's status is known.
  void launch_ready() {
    while (next_launch + 1 < buckets.size() && buckets[next_launch].pending == 0)
      launch(buckets[next_launch++]);
  }

  void launch(Bucket& b) {
    if (stats.ready_before_first_launch < 0) stats.ready_before_first_launch = ready_count;
    if (!b.wire.is_same(b.buffer)) b.wire.copy_(b.buffer);
    b.work = dist::all_reduce(b.wire, dist::ReduceOp::Avg, group, /*async_op=*/true);
    b.launched = true;
  }

  void build_buckets(const std::vector<int>& order) {
    for (const auto& members :
         detail::cut_buckets(order, params, options.first_bucket_mb, options.bucket_mb)) {
      buckets.emplace_back();
      buckets.back().params = members;
    }
    views.assign(params.size(), Tensor());
    bucket_of.assign(params.size(), -1);
    for (size_t b = 0; b < buckets.size(); ++b) {
      Bucket& bucket = buckets[b];
      const Tensor& first = params[bucket.params.front()];
      int64_t total = 0;
      for (int i : bucket.params) total += params[i].numel();
      if (b + 1 == buckets.size()) total += kStatusWords;
      bucket.buffer = zeros({total}, {.dtype = first.dtype(), .device = first.device()});
      bucket.wire = options.compress && *options.compress != first.dtype()
                        ? empty({total}, {.dtype = *options.compress, .device = first.device()})
                        : bucket.buffer;
      int64_t offset = 0;
      for (int i : bucket.params) {
        views[i] =
            make_view(bucket.buffer, params[i].shape(), contiguous_strides(params[i].shape()),
                      bucket.buffer.offset() + offset);
        bucket_of[i] = int(b);
        offset += params[i].numel();
      }
    }
    stats.buckets = int(buckets.size());
    traced = true;
  }

  std::vector<std::string> unused_names() const {
    std::vector<std::string> unused;
    for (size_t i = 0; i < params.size(); ++i)
      if (!ready[i]) unused.push_back(names[i]);
    return unused;
  }

  // Ends a synchronizing step on this rank, in step with the group: launches what is left,
  // waits for every bucket, learns every rank's status from the status words and acts on it
  // alike everywhere. `failed`: this rank's backward unwound (or, from forward, never ran).
  // Raises on the ranks that did not fail when another did; never on a failed rank (its own
  // error is the one to report), except for what every rank raises alike.
  void settle(bool failed) {
    if (!in_backward) begin_step();  // settling a step whose backward never reached us
    in_backward = false;
    forward_pending = false;
    const int64_t step = stats.steps++;
    const bool has_unused = !failed && ready_count < int64_t(params.size());
    int64_t failed_ranks = 0, unused_ranks = 0;
    if (!traced) {
      // Every rank must cut the same buckets, or their all_reduces would not pair up: all take
      // the first rank's order, agreeing on the statuses in the same round.
      bool differs = false;
      std::vector<int64_t> flags = {failed ? 1 : 0, has_unused ? 1 : 0};
      const std::vector<int> order = detail::agree_on_order(failed ? std::vector<int>{} : trace,
                                                            params.size(), group, differs, &flags);
      trace.clear();
      failed_ranks = flags[kFailed];
      unused_ranks = flags[kUnused];
      if (failed_ranks == 0) {
        if (differs && !options.find_unused_parameters) {
          check_used(unused_ranks, has_unused);  // the likely cause, named where a rank has it
          WEAVE_FAIL("DistributedDataParallel",
                     "ranks produced gradients in different orders in the first backward, so "
                     "their buckets would differ; hint: every rank must run the same model code "
                     "on inputs of the same structure, or construct with "
                     "{{.find_unused_parameters = true}}");
        }
        build_buckets(order);
        for (size_t i = 0; i < params.size(); ++i) into_bucket(int(i));
        while (next_launch < buckets.size()) launch(buckets[next_launch++]);
        wait_all();
      }
    } else {
      // Parameters without a gradient from this backward keep what they accumulated (no_sync
      // micro-batches) or contribute zeros; then every bucket is complete.
      for (size_t i = 0; i < params.size(); ++i)
        if (!ready[i]) into_bucket(int(i));
      for (Bucket& b : buckets) b.pending = 0;
      launch_ready();
      Tensor words = buckets.back().buffer.narrow(0, buckets.back().buffer.numel() - kStatusWords,
                                                  kStatusWords);
      words.narrow(0, kFailed, 1).fill_(failed ? 1.0 : 0.0);
      words.narrow(0, kUnused, 1).fill_(has_unused ? 1.0 : 0.0);
      launch(buckets[next_launch++]);
      wait_all();
      // The average of 0/1 words times the group size counts the ranks that set them.
      const std::vector<double> averaged = words.to(kFloat64).cpu().to_vector<double>();
      failed_ranks = std::llround(averaged[kFailed] * group.size());
      unused_ranks = std::llround(averaged[kUnused] * group.size());
    }
    if (failed_ranks > 0) {  // every rank discards the step (an untraced one traces again)
      optim::zero_grad(params, /*set_to_none=*/false);
      ++stats.failed_steps;
      if (failed) return;  // this rank's own error is the one to report
      WEAVE_FAIL("DistributedDataParallel",
                 "{} of the {} ranks of group {} failed or skipped backward in step {} (see "
                 "their error), so every rank discarded this step's gradients (they are zero); "
                 "hint: catch this error and go on to the next batch on every rank, as the "
                 "failing rank does",
                 failed_ranks, group.size(), group.str(), step);
    }
    stats.unused = unused_names();
    stats.parameters = int64_t(params.size());
    // Unused parameters still get the group's average (their peers may have used them).
    for (size_t i = 0; i < params.size(); ++i)
      if (!ready[i]) params[i].set_grad(views[i]);
    if (!options.find_unused_parameters) check_used(unused_ranks, has_unused);
    if (options.check_finite) check_gradients_finite(step);
  }

  // What a synchronizing forward communicates before the module runs (also when join()
  // shadows it): the step's number on the group, then the buffers.
  void start_step(nn::Module& module) {
    dist::set_step(group, stats.steps);
    if (!options.broadcast_buffers) return;
    NoGradGuard no_grad;
    std::vector<dist::Work> works;
    for (const Tensor& t : module.buffers())
      if (t.defined())
        works.push_back(dist::broadcast(t, options.broadcast_from, group, /*async_op=*/true));
    for (dist::Work& w : works) w.wait();
  }

  // join(): a step of the others in which this rank, out of inputs, contributes zeros.
  void shadow_step(nn::Module& module) {
    start_step(module);
    begin_step();
    for (Bucket& b : buckets) b.buffer.zero_();
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].set_grad(views[i]);
      ready[i] = 1;
    }
    ready_count = int64_t(params.size());
    settle(/*failed=*/false);
  }

  void wait_all() {
    for (Bucket& b : buckets) {
      b.work.wait();
      if (!b.wire.is_same(b.buffer)) b.buffer.copy_(b.wire);
    }
  }

  // Without find_unused_parameters, a parameter without gradient on any rank raises on every
  // rank; the ranks that have one name theirs.
  void check_used(int64_t unused_ranks, bool has_unused) const {
    if (unused_ranks == 0) return;
    WEAVE_CHECK(!has_unused, "DistributedDataParallel",
                "parameters got no gradient in this backward: {}; hint: construct with "
                "{{.find_unused_parameters = true}} if the model leaves some unused",
                unused_names());
    WEAVE_FAIL("DistributedDataParallel",
               "{} rank(s) of group {} have parameters that got no gradient in this backward "
               "(see their error); hint: construct with {{.find_unused_parameters = true}} if "
               "the model leaves some unused",
               unused_ranks, group.str());
  }

  // The averaged gradients are equal on every rank, so is this verdict.
  void check_gradients_finite(int64_t step) {
    std::vector<Tensor> buffers;
    for (const Bucket& b : buckets) buffers.push_back(b.buffer);
    finite = all_finite(buffers);
    if (finite) return;
    std::string first;
    for (size_t i = 0; i < params.size() && first.empty(); ++i)
      if (!all_finite(views[i])) first = names[i];
    WEAVE_FAIL("DistributedDataParallel",
               "the averaged gradients of step {} hold NaN or infinity (first in {}); every rank "
               "of group {} raises; hint: skip this step on every rank (zero_grad, no "
               "optimizer step), or lower the learning rate or loss scale",
               step, first, group.str());
  }
};

DistributedDataParallel::DistributedDataParallel(nn::Module& module, DDPOptions options)
    : module_(module), state_(std::make_shared<State>(std::move(options))) {
  State& s = *state_;
  WEAVE_CHECK(s.options.first_bucket_mb > 0 && s.options.bucket_mb > 0, "DistributedDataParallel",
              "bucket sizes must be positive, found {} and {} MB", s.options.first_bucket_mb,
              s.options.bucket_mb);
  WEAVE_CHECK(!s.options.compress || *s.options.compress == kBFloat16 ||
                  *s.options.compress == kFloat16 || *s.options.compress == kFloat32,
              "DistributedDataParallel", "compress must be bfloat16, float16 or float32, found {}",
              *s.options.compress);
  WEAVE_CHECK(s.group.rank() >= 0, "DistributedDataParallel",
              "rank {} is not in group {}; hint: only its members construct the wrapper",
              dist::rank(), s.group.str());
  check_same_model(module, s.group);
  synchronize(module, s.options.broadcast_from, s.group);
  for (const auto& [name, p] : module.named_parameters()) {
    if (!p.defined() || !p.requires_grad()) continue;
    WEAVE_CHECK(is_floating(p.dtype()), "DistributedDataParallel",
                "parameter {} has dtype {}; gradients need a floating dtype", name, p.dtype());
    s.names.push_back(name);
    s.params.push_back(p);
  }
  s.ready.assign(s.params.size(), 0);
  s.hooks = detail::hook_ready(s.params, state_);
}

DistributedDataParallel::~DistributedDataParallel() {
  for (HookHandle& hook : state_->hooks) hook.remove();
}

Tensor DistributedDataParallel::forward(const Tensor& input) {
  State& s = *state_;
  const bool synchronizing = autograd::GradMode::is_enabled() && !s.no_sync;
  // The previous synchronizing forward got no backward on this rank (skipped, or it failed
  // before reaching this model): settle that step with the group now, as failed, so the peers'
  // all_reduces of that step pair with this rank's and nothing pairs across steps.
  if (s.forward_pending && synchronizing) {
    std::fprintf(stderr,
                 "[weave] rank %d: DistributedDataParallel: step %lld's forward got no backward "
                 "on this rank; its gradients are discarded on every rank; hint: run evaluation "
                 "under NoGradGuard\n",
                 dist::rank(), static_cast<long long>(s.stats.steps));
    s.settle(true);
  }
  if (synchronizing) {
    detail::join_step_begins(this);
    s.start_step(module_);
  }
  s.forward_pending = synchronizing;
  // Gradients dropped by zero_grad(set_to_none = true) go back into their buckets, zeroed,
  // so backward accumulates in place instead of copying in afterwards.
  if (s.traced && !s.no_sync) {
    NoGradGuard no_grad;
    for (size_t i = 0; i < s.params.size(); ++i)
      if (!s.params[i].grad().defined()) {
        s.views[i].zero_();
        s.params[i].set_grad(s.views[i]);
      }
  }
  return module_(input);
}

DistributedDataParallel::NoSyncGuard::NoSyncGuard(DistributedDataParallel& ddp)
    : ddp_(ddp), previous_(ddp.state_->no_sync) {
  ddp_.state_->no_sync = true;
}
DistributedDataParallel::NoSyncGuard::~NoSyncGuard() {
  ddp_.state_->no_sync = previous_;
}

const DDPStats& DistributedDataParallel::stats() const {
  return state_->stats;
}

bool DistributedDataParallel::gradients_finite() const {
  return state_->finite;
}

const dist::Group& DistributedDataParallel::group() const {
  return state_->group;
}

bool DistributedDataParallel::can_shadow() const {
  return state_->traced;
}

void DistributedDataParallel::shadow_step() {
  state_->shadow_step(module_);
}

std::vector<std::vector<std::string>> DistributedDataParallel::bucket_names() const {
  std::vector<std::vector<std::string>> out;
  for (const auto& bucket : state_->buckets) {
    out.emplace_back();
    for (int i : bucket.params) out.back().push_back(state_->names[i]);
  }
  return out;
}

}  // namespace weave::parallel

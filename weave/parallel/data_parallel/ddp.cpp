// DistributedDataParallel: model agreement, broadcast, gradient buckets traced in the first
// backward, per-bucket asynchronous averaging launched from post-accumulate hooks, and the
// end-of-backward wait.
#include "weave/parallel/data_parallel/ddp.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/nn/deferred.h"
#include "weave/optim/optimizer.h"
#include "weave/parallel/core/agree.h"
#include "weave/parallel/core/flat_buffer.h"
#include "weave/parallel/core/mesh.h"
#include "weave/parallel/core/placement.h"
#include "weave/parallel/core/readiness.h"
#include "weave/parallel/core/reproducible.h"

namespace weave::parallel {

// ---- the reducer -------------------------------------------------------------------------

namespace {
// The status words after the last bucket's gradients: this rank's backward failed (or was
// skipped); this rank has parameters without a gradient.
constexpr int64_t kStatusWords = 2;
enum StatusWord { kFailed = 0, kUnused = 1 };
}  // namespace

struct DistributedDataParallel::State {
  // The last bucket holds the status words after its gradients.
  using Bucket = detail::GradBucket;

  DDPOptions options;
  dist::Group group;
  std::vector<std::string> names;
  std::vector<Tensor> params;
  std::vector<Tensor> views;  // params[i]'s gradient inside its bucket
  std::vector<Bucket> buckets;
  std::vector<int> bucket_group;   // each bucket's entry in replicas.groups
  detail::ReplicaGroups replicas;  // where each parameter's gradient is averaged, and its scale
  std::shared_ptr<detail::GradReadiness> readiness;
  std::unique_ptr<detail::ReproducibleGradients> reproducible;  // options.reproducible
  bool finite = true;
  DDPStats stats;

  explicit State(DDPOptions o)
      : options(std::move(o)),
        group(detail::data_parallel_group(options.group, "DistributedDataParallel")) {}

  void watch() {
    readiness = detail::GradReadiness::create(
        params,
        {.ready = [this](int i) { detail::bind_grad(params[i], views[i]); },
         .launch =
             [this](int b) {
               if (reproducible) return;  // the end of backward sums every bucket at once
               buckets[size_t(b)].launch_average(replicas.groups[size_t(bucket_group[size_t(b)])]);
             },
         .finish =
             [this](bool failed) {
               if (reproducible)
                 settle_reproducible(failed);
               else
                 settle(failed);
             }});
  }

  // Each bucket holds parameters of one replica group (experts apart from the dense ones), cut
  // from the traced order; buckets launch in the order their last gradient arrives. The last
  // bucket, a dense one that carries the status words (alone when nothing is dense), is held
  // back until the end of backward, when this rank's status is known.
  void build_buckets(const std::vector<int>& order) {
    std::vector<std::pair<size_t, int>> ends;  // (position of its last member in order, group)
    std::vector<std::vector<int>> members;
    for (size_t k = 0; k < replicas.groups.size(); ++k) {
      std::vector<int> mine;
      for (int i : order)
        if (replicas.of[size_t(i)] == int(k)) mine.push_back(i);
      for (std::vector<int>& bucket :
           detail::cut_buckets(mine, params, options.first_bucket_mb, options.bucket_mb)) {
        const auto last = std::find(order.begin(), order.end(), bucket.back());
        ends.push_back({size_t(last - order.begin()), int(k)});
        members.push_back(std::move(bucket));
      }
    }
    std::vector<size_t> by_end(members.size());
    for (size_t b = 0; b < by_end.size(); ++b) by_end[b] = b;
    std::stable_sort(by_end.begin(), by_end.end(),
                     [&](size_t a, size_t b) { return ends[a].first < ends[b].first; });
    // The last dense bucket goes last (or an empty one is added): it carries the status words.
    auto dense =
        std::find_if(by_end.rbegin(), by_end.rend(), [&](size_t b) { return ends[b].second == 0; });
    if (dense == by_end.rend()) {
      members.emplace_back();
      ends.push_back({order.size(), 0});
      by_end.push_back(members.size() - 1);
    } else {
      std::rotate(dense.base() - 1, dense.base(), by_end.end());
    }
    std::vector<std::vector<int>> launch_order;
    views.assign(params.size(), Tensor());
    for (size_t b : by_end) {
      std::vector<Tensor> bucket_params;
      for (int i : members[b]) bucket_params.push_back(params[size_t(i)]);
      Bucket bucket =
          Bucket::allocate(bucket_params, options.compress, b == by_end.back() ? kStatusWords : 0);
      bucket.scale = replicas.scale(ends[b].second);
      for (size_t k = 0; k < members[b].size(); ++k)
        views[size_t(members[b][k])] = bucket.grads.view(k);
      buckets.push_back(std::move(bucket));
      bucket_group.push_back(ends[b].second);
      launch_order.push_back(std::move(members[b]));
    }
    readiness->set_buckets(std::move(launch_order), /*held_back=*/1);
    stats.buckets = int(buckets.size());
  }

  std::vector<std::string> unused_names() const {
    std::vector<std::string> unused;
    for (size_t i = 0; i < params.size(); ++i)
      if (!readiness->is_ready(int(i))) unused.push_back(names[i]);
    return unused;
  }

  // Ends a synchronizing step on this rank, in step with the group: launches what is left,
  // waits for every bucket, learns every rank's status from the status words and acts on it
  // alike everywhere. `failed`: this rank's backward unwound (or, from forward, never ran).
  // Raises on the ranks that did not fail when another did; never on a failed rank (its own
  // error is the one to report), except for what every rank raises alike.
  void settle(bool failed) {
    const int64_t step = stats.steps++;
    finite = true;  // this step's verdict, below
    const bool has_unused = !failed && readiness->ready_count() < int64_t(params.size());
    int64_t failed_ranks = 0, unused_ranks = 0;
    if (!readiness->has_buckets()) {
      // Every rank must cut the same buckets, or their all_reduces would not pair up: all take
      // the first rank's order, agreeing on the statuses in the same round.
      bool differs = false;
      std::vector<int> trace = readiness->take_trace();
      std::vector<int64_t> flags = {failed ? 1 : 0, has_unused ? 1 : 0};
      const std::vector<int> order = detail::agree_on_order(failed ? std::vector<int>{} : trace,
                                                            params.size(), group, differs, &flags);
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
        for (size_t i = 0; i < params.size(); ++i) detail::bind_grad(params[i], views[i]);
        readiness->launch_rest();
        wait_all();
      }
      stats.ready_before_first_launch = readiness->ready_count();  // nothing overlapped
    } else {
      // Parameters without a gradient from this backward keep what they accumulated (no_sync
      // micro-batches) or contribute zeros; then every bucket is complete.
      for (size_t i = 0; i < params.size(); ++i)
        if (!readiness->is_ready(int(i))) detail::bind_grad(params[i], views[i]);
      const Tensor& last = buckets.back().grads.flat;
      Tensor words = last.narrow(0, last.numel() - kStatusWords, kStatusWords);
      words.narrow(0, kFailed, 1).fill_(failed ? 1.0 : 0.0);
      words.narrow(0, kUnused, 1).fill_(has_unused ? 1.0 : 0.0);
      readiness->launch_rest();
      wait_all();
      // The average of 0/1 words times the group size counts the ranks that set them.
      const std::vector<double> averaged = words.to(kFloat64).cpu().to_vector<double>();
      failed_ranks = std::llround(averaged[kFailed] * group.size());
      unused_ranks = std::llround(averaged[kUnused] * group.size());
      stats.ready_before_first_launch = readiness->ready_at_first_launch();
    }
    if (failed_ranks > 0) return discard_step(failed, failed_ranks, step);
    finish_step(unused_ranks, has_unused, step);
  }

  // Some rank failed or skipped backward: every rank discards the step (an untraced one traces
  // again); the ranks that did not fail raise.
  void discard_step(bool failed, int64_t failed_ranks, int64_t step) {
    if (reproducible) reproducible->discard();
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

  void finish_step(int64_t unused_ranks, bool has_unused, int64_t step) {
    stats.unused = unused_names();
    stats.parameters = int64_t(params.size());
    if (!options.find_unused_parameters) check_used(unused_ranks, has_unused);
    if (options.check_finite) check_gradients_finite(step);
  }

  // settle() in reproducible mode: the buckets only hold the gradients (cut from the first
  // backward's order, as always). The last micro-batch has joined the binned sums (its end
  // came first); the ranks agree on their counts and statuses, and every gradient gets the sum
  // over all micro-batches of the group divided by their number.
  void settle_reproducible(bool failed) {
    const int64_t step = stats.steps++;
    finite = true;
    const bool has_unused = !failed && readiness->ready_count() < int64_t(params.size());
    if (!readiness->has_buckets()) {
      bool differs = false;
      build_buckets(detail::agree_on_order(failed ? std::vector<int>{} : readiness->take_trace(),
                                           params.size(), group, differs));
    }
    for (size_t i = 0; i < params.size(); ++i)
      if (!params[i].grad().is_same(views[i])) detail::bind_grad(params[i], views[i]);
    readiness->launch_rest();  // launches nothing: the buckets' bookkeeping ends the step
    const detail::ReproducibleGradients::Agreement agreement =
        reproducible->agree(group, {failed ? 1 : 0, has_unused ? 1 : 0});
    stats.ready_before_first_launch = int64_t(params.size());  // nothing overlaps backward
    if (agreement.flagged[kFailed] > 0)
      return discard_step(failed, agreement.flagged[kFailed], step);
    reproducible->reduce_into(views, group, agreement.microbatches);
    finish_step(agreement.flagged[kUnused], has_unused, step);
  }

  // What a synchronizing forward communicates before the module runs (also when join()
  // shadows it): the step's number on the group, then the buffers.
  void start_step(nn::Module& module) {
    dist::set_step(group, stats.steps);
    const int64_t every = options.check_replicas_every;
    if (every > 0 && stats.steps > 0 && stats.steps % every == 0) check_replicas(module, group);
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
    WEAVE_CHECK(!reproducible, "DistributedDataParallel",
                "join() shadows a step with zero gradients, which reproducible mode would count "
                "as a micro-batch; hint: give every rank the same number of micro-batches "
                "(parallel::MicroBatchPlan), or leave reproducible off");
    start_step(module);
    readiness->clear();
    for (Bucket& b : buckets) b.grads.flat.zero_();
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].set_grad(views[i]);
      readiness->mark_ready(int(i));
    }
    settle(/*failed=*/false);
  }

  void wait_all() {
    for (Bucket& b : buckets) b.wait();
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
    for (const Bucket& b : buckets) buffers.push_back(b.grads.flat);
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
  detail::check_bucket_sizes("DistributedDataParallel", s.options.first_bucket_mb,
                             s.options.bucket_mb);
  WEAVE_CHECK(!s.options.compress || *s.options.compress == kBFloat16 ||
                  *s.options.compress == kFloat16 || *s.options.compress == kFloat32,
              "DistributedDataParallel", "compress must be bfloat16, float16 or float32, found {}",
              *s.options.compress);
  WEAVE_CHECK(s.group.rank() >= 0, "DistributedDataParallel",
              "rank {} is not in group {}; hint: only its members construct the wrapper",
              dist::rank(), s.group.str());
  WEAVE_CHECK(s.options.check_replicas_every >= 0, "DistributedDataParallel",
              "check_replicas_every must be 0 (never) or a number of steps, found {}",
              s.options.check_replicas_every);
  // Each rank holds the whole model: a deferred one is drawn here, its seed agreed with the
  // ranks holding the other pieces (tensor-parallel, experts); the replicas are overwritten
  // from broadcast_from below.
  const dist::KeepAlive alive;  // drawing a large deferred model may outlast --hang-timeout
  detail::materialize_replicas(module, s.group, "DistributedDataParallel");
  for (const auto& [name, p] : module.named_parameters()) {
    if (!p.defined() || !p.requires_grad()) continue;
    WEAVE_CHECK(is_floating(p.dtype()), "DistributedDataParallel",
                "parameter {} has dtype {}; gradients need a floating dtype", name, p.dtype());
    s.names.push_back(name);
    s.params.push_back(p);
  }
  s.replicas = detail::replica_groups(s.names, s.params, s.group, "DistributedDataParallel");
  if (s.options.reproducible) {
    WEAVE_CHECK(!s.options.compress, "DistributedDataParallel",
                "reproducible mode sums the gradients in integers; compress {} would round them "
                "first; hint: leave compress unset",
                *s.options.compress);
    detail::check_reproducible(s.names, s.params, s.group, "DistributedDataParallel");
    s.reproducible =
        std::make_unique<detail::ReproducibleGradients>(s.params, "DistributedDataParallel");
  }
  detail::broadcast_replicas(module, s.params, s.replicas, s.options.broadcast_from);
  s.watch();
}

DistributedDataParallel::~DistributedDataParallel() = default;

Tensor DistributedDataParallel::forward(const nn::Inputs& inputs) {
  State& s = *state_;
  const bool synchronizing = s.readiness->begin_forward("DistributedDataParallel", s.stats.steps);
  if (synchronizing) {
    detail::join_step_begins(this);
    s.start_step(module_);
  }
  if (synchronizing) s.readiness->expect_backward();
  if (s.reproducible && autograd::GradMode::is_enabled()) s.reproducible->note_rows(inputs);
  // Gradients dropped by zero_grad(set_to_none = true) go back into their buckets, zeroed,
  // so backward accumulates in place instead of copying in afterwards.
  if (s.readiness->has_buckets() && !s.readiness->paused()) {
    NoGradGuard no_grad;
    for (size_t i = 0; i < s.params.size(); ++i)
      if (!s.params[i].grad().defined()) {
        s.views[i].zero_();
        s.params[i].set_grad(s.views[i]);
      }
  }
  Tensor output = module_(inputs);
  if (synchronizing) s.readiness->set_forward_output(output);
  return output;
}

NoSyncGuard DistributedDataParallel::no_sync() {
  return NoSyncGuard(state_->readiness);
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

bool DistributedDataParallel::can_shadow_join_step() const {
  return state_->readiness->has_buckets();
}

void DistributedDataParallel::shadow_join_step() {
  state_->shadow_step(module_);
}

void DistributedDataParallel::abandon_join_step() {
  state_->readiness->settle_skipped_backward("DistributedDataParallel", state_->stats.steps);
}

void DistributedDataParallel::check_join_ended() {
  const detail::ReplicaGroups& replicas = state_->replicas;
  for (size_t k = 0; k < replicas.groups.size(); ++k)
    detail::check_same_lines(
        detail::describe_values(replicas.members(state_->params, int(k))), replicas.groups[k],
        "join", "the parameters' values after join()",
        "a rank that ran out of batches did not step its optimizer; list the "
        "optimizer after the DDP wrapper: parallel::join({ddp, optimizer}, ...)");
}

std::vector<std::vector<std::string>> DistributedDataParallel::bucket_names() const {
  std::vector<std::vector<std::string>> out;
  for (const auto& bucket : state_->readiness->buckets()) {
    out.emplace_back();
    for (int i : bucket) out.back().push_back(state_->names[size_t(i)]);
  }
  return out;
}

}  // namespace weave::parallel

// FullyShardedDataParallel's phases: the forward hooks (gather, prefetch, release), the backward
// hooks (gather, bind, reduce_scatter in the fixed order), the settling all_reduce, and the
// replays that keep a rank that failed or ran out of inputs in step with its peers.
#include "weave/parallel/data_parallel/fsdp_state.h"

#include <algorithm>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/ops/ops.h"
#include "weave/parallel/core/agree.h"
#include "weave/parallel/core/mesh.h"
#include "weave/tensor/trace.h"

namespace weave::parallel {

namespace {
// The checkpointed region of a unit runs again inside backward (autograd::checkpoint): its hooks
// gather but neither prefetch in forward order nor release.
bool recomputing() {
  return autograd::detail::recomputing();
}
}  // namespace

FullyShardedDataParallel::State::State(FSDPOptions o)
    : options(std::move(o)), group(detail::data_parallel_group(options.group, kFSDPOp)) {}

int FullyShardedDataParallel::State::next_in_forward(int u, int direction) const {
  if (!order_known) return direction > 0 && u + 1 < int(units.size()) - 1 ? u + 1 : -1;
  auto it = std::find(forward_order.begin(), forward_order.end(), u);
  if (it == forward_order.end()) return -1;
  const auto pos = it - forward_order.begin() + direction;
  return pos >= 0 && pos < int64_t(forward_order.size()) ? forward_order[size_t(pos)] : -1;
}

void FullyShardedDataParallel::State::pre_forward(int u) {
  Unit& unit = units[size_t(u)];
  ensure_gathered(unit);
  if (recomputing()) return;
  unit.marks().forward_began = true;
  if (!order_known &&
      std::find(forward_order.begin(), forward_order.end(), u) == forward_order.end())
    forward_order.push_back(u);
  if (options.prefetch) {
    const int next = next_in_forward(u, +1);
    if (next >= 0) units[size_t(next)].launch_gather(stats, /*prefetch=*/true);
  }
  if (trace::enabled()) unit.marks().forward_start_ns = trace::detail::now_ns();
}

Tensor FullyShardedDataParallel::State::post_forward(int u, const Tensor& output) {
  Unit& unit = units[size_t(u)];
  if (recomputing()) return output;  // its backward follows at once: keep it gathered
  if (trace::enabled())
    trace::detail::record("fsdp", fmt::format("forward unit {}", u), unit.marks().forward_start_ns,
                          trace::detail::now_ns(), fmt::format("\"unit\": {}", u));
  if (autograd::GradMode::is_enabled() && output.defined() && output.requires_grad()) {
    std::weak_ptr<State> weak = self;
    output.register_hook([weak, u](const Tensor&) -> Tensor {
      if (auto s = weak.lock()) s->pre_backward(u);
      return {};
    });
  }
  release(unit);
  return output;
}

void FullyShardedDataParallel::State::pre_backward(int u) {
  queue_end_of_backward();
  for (int done : std::exchange(release_after, {}))
    if (done != u) release(units[size_t(done)]);
  gather_for_backward(u);
  bind_grads(units[size_t(u)]);
}

void FullyShardedDataParallel::State::gather_for_backward(int u) {
  Unit& unit = units[size_t(u)];
  unit.marks().backward_began = true;
  ensure_gathered(unit);
  if (options.prefetch) {
    const int previous = next_in_forward(u, -1);
    if (previous >= 0) units[size_t(previous)].launch_gather(stats, /*prefetch=*/true);
  }
}

std::vector<int> FullyShardedDataParallel::State::completed_forward_order() const {
  std::vector<int> order = forward_order;
  for (int u = 0; u + 1 < int(units.size()); ++u)
    if (std::find(order.begin(), order.end(), u) == order.end()) order.push_back(u);
  return order;
}

nn::NamedTensors FullyShardedDataParallel::State::named_shards() const {
  nn::NamedTensors out;
  for (size_t u = 0; u < units.size(); ++u)
    for (const Flat& f : units[u].flats())
      out.emplace_back(fmt::format("unit{}_{}{}", u, dtype_name(f.shard.dtype()), f.suffix),
                       f.shard);
  return out;
}

void FullyShardedDataParallel::State::replay_rest_of_backward(bool reduce) {
  const std::vector<int> order = completed_forward_order();
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    if (!units[size_t(*it)].marks().backward_began) gather_for_backward(*it);
    if (!reduce) continue;
    for (const Flat& f : units[size_t(*it)].flats())
      if (!f.frozen)
        for (int i : f.params) readiness->mark_ready(i);
  }
}

void FullyShardedDataParallel::State::replay_rest_of_forward() {
  forward_order = completed_forward_order();
  order_known = true;
  for (int u : forward_order) {
    if (!units[size_t(u)].marks().forward_began) pre_forward(u);
    release(units[size_t(u)]);
  }
}

// Synchronizing: the reduce_scatters and the settling all_reduce, the step failed; no_sync: the
// backward's gathers only; grad mode off: no backward follows.
void FullyShardedDataParallel::State::abandon_forward(bool synchronizing) {
  replay_rest_of_forward();
  if (synchronizing) {
    readiness->clear();
    settle(/*failed=*/true);  // releases every unit
    return;
  }
  if (autograd::GradMode::is_enabled()) replay_rest_of_backward(/*reduce=*/false);
  for (Unit& u : units) release(u);
}

void FullyShardedDataParallel::State::launch_reduce(int u) {
  Unit& unit = units[size_t(u)];
  unit.launch_reduce(params, stats);
  // At most two units' whole gradients are alive: the one just launched, and the one before
  // while its reduce-scatter completes (it overlapped this unit's backward).
  for (int earlier : reducing) finish_reduce(units[size_t(earlier)]);
  reducing.assign(1, u);
  if (unit.root()) return;
  const auto& flats = unit.flats();
  if (std::any_of(flats.begin(), flats.end(), [](const Flat& f) { return f.frozen; }))
    release_after.push_back(u);
  else
    release(unit);
}

void FullyShardedDataParallel::State::queue_end_of_backward() {
  if (end_queued) return;
  end_queued = true;
  std::weak_ptr<State> weak = self;
  autograd::queue_final_callback([weak](bool) {
    if (auto s = weak.lock()) s->end_of_backward();
  });
}

void FullyShardedDataParallel::State::end_of_backward() {
  end_queued = false;
  release_after.clear();  // released below, or by settle
  if (readiness->backward_expected()) return;
  for (Unit& u : units) release(u);
}

bool FullyShardedDataParallel::State::diverged() const {
  return dist::disagreements(group) != disagreements_seen;
}

bool FullyShardedDataParallel::State::finish_step_collectives(bool failed) {
  // Once a call of the group failed its check, the ranks stand at different calls: what is
  // left to issue could only fail too.
  auto unless_diverged = [this](auto&& issue) {
    if (diverged()) return;
    try {
      issue();
    } catch (const Error&) {
      if (!diverged()) throw;
    }
  };
  if (failed) unless_diverged([&] { replay_rest_of_backward(); });
  unless_diverged([&] { readiness->launch_rest(); });
  for (int u : reducing) unless_diverged([&] { finish_reduce(units[size_t(u)]); });
  reducing.clear();
  for (Unit& u : units) unless_diverged([&] { u.finish_replicate(); });
  return diverged();
}

int64_t FullyShardedDataParallel::State::count_failed_ranks(bool failed) {
  for (;;) {
    if (diverged()) {
      dist::realign(group);
      disagreements_seen = dist::disagreements(group);
      failed = true;
    }
    try {
      const int64_t here = int64_t(detail::ranks_where({failed}, group)[0].size());
      if (!options.replicate_group) return here;
      // HSDP: the replicas averaged one another's shards, so they keep or discard together.
      Tensor total = full({1}, double(here), {.dtype = kFloat64});
      dist::all_reduce(total, dist::ReduceOp::Sum, *options.replicate_group);
      return int64_t(total.item<double>());
    } catch (const Error&) {
      if (!diverged()) throw;  // a peer is realigning: meet it there
    }
  }
}

void FullyShardedDataParallel::State::settle(bool failed) {
  const int64_t step = stats.steps++;
  const bool diverged_here = finish_step_collectives(failed);
  const int64_t failed_ranks = count_failed_ranks(failed || diverged_here);
  NoGradGuard no_grad;
  if (options.reproducible) reduce_reproducibly(/*keep=*/failed_ranks == 0);
  finite = !(failed_ranks == 0 && options.check_finite) || agree_finite();
  for (Unit& u : units) {
    if (failed_ranks > 0) u.discard_step(params);
    u.settle_reduced(/*keep=*/failed_ranks == 0);
    release(u);
  }
  if (failed_ranks > 0) ++stats.failed_steps;
  if (diverged_here && !failed)
    WEAVE_FAIL(kFSDPOp,
               "the collectives of step {} did not pair across the ranks of group {} (a rank's "
               "forward or backward took another path through the units; see the mismatch "
               "reported above or by the other ranks), so every rank discarded the step and "
               "the group was realigned; hint: every rank must run the same units in the same "
               "order in each step",
               step, group.str());
  if (failed_ranks == 0 && !finite)
    WEAVE_FAIL(kFSDPOp,
               "the averaged gradients of step {} hold NaN or infinity; every rank of group {} "
               "raises; hint: skip this step on every rank (zero_grad, no optimizer step), or "
               "lower the learning rate or loss scale",
               step, group.str());
  if (failed_ranks == 0 || failed) return;  // a failed rank's own error is the one to report
  WEAVE_FAIL(kFSDPOp,
             "{} of the {} ranks of group {} failed in forward or backward in step {} (see "
             "their error), so every rank discarded this step's gradients; hint: catch this "
             "error and go on to the next batch on every rank, as the failing rank does",
             failed_ranks, group.size(), group.str(), step);
}

void FullyShardedDataParallel::State::reduce_reproducibly(bool keep) {
  std::vector<Flat*> flats;
  for (Unit& u : units)
    for (Flat& f : u.flats())
      if (f.sums) flats.push_back(&f);
  if (flats.empty()) return;
  if (!keep) {
    for (Flat* f : flats) f->sums->discard();
    return;
  }
  // Every flat counted the same backwards; the first one's count stands for all.
  const dist::Group* replicas = options.replicate_group ? &*options.replicate_group : nullptr;
  const int64_t microbatches = flats.front()->sums->agree(group, {}, replicas).microbatches;
  for (Flat* f : flats) {
    Tensor shard =
        empty(f->shard.shape(), {.dtype = f->shard.dtype(), .device = f->shard.device()});
    f->sums->reduce_scatter_into(shard, f->group, microbatches,
                                 f->replicate ? &*f->replicate : nullptr);
    f->reduced = shard;
  }
}

void FullyShardedDataParallel::State::shadow_step() {
  // Its gradients are this step's average alone, as a training rank's after zero_grad.
  for (Unit& u : units)
    for (Flat& f : u.flats()) f.shard.set_grad(Tensor());
  dist::set_step(group, stats.steps);
  new_forward(/*with_backward=*/true);
  ensure_gathered(root());
  replay_rest_of_forward();
  readiness->clear();
  replay_rest_of_backward();
  settle(/*failed=*/false);
}

bool FullyShardedDataParallel::State::agree_finite() {
  std::vector<Tensor> reduced;
  for (const Unit& u : units)
    for (const Flat& f : u.flats()) reduced.push_back(f.reduced);
  return detail::all_agree(all_finite(reduced), group);
}

}  // namespace weave::parallel

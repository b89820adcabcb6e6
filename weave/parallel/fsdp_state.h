#pragma once
// FullyShardedDataParallel's state and the logic of its phases (internal): fsdp.cpp wires it to
// the module's hooks and the optimizer; fsdp_state_dict.cpp reads and writes through it.
#include <memory>
#include <string>
#include <vector>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/parallel/agree.h"
#include "weave/parallel/ddp.h"
#include "weave/parallel/flat_buffer.h"
#include "weave/parallel/fsdp.h"
#include "weave/parallel/mesh.h"
#include "weave/tensor/trace.h"

namespace weave::parallel {

/// The name FSDP's errors carry.
inline constexpr const char* kFSDPOp = "FullyShardedDataParallel";

struct FullyShardedDataParallel::State {
  // One dtype's parameters of a unit, flat.
  struct Flat {
    std::vector<int> params;  // indices into State::params
    detail::FlatBuffer full;  // gathered parameters (the params' memory); released between uses
    Tensor shard;             // this rank's slice, a leaf of its own: what the optimizer steps
    uint64_t gathered_version = ~uint64_t{0};  // shard's version when `full` was last gathered
    dist::Work gather;
    bool gathering = false;
    // A gather that refills released memory with unchanged values keeps the storage's version,
    // so the tensors autograd saved from the parameters in forward stay valid for backward.
    bool refill = false;
    uint64_t version_before = 0;
    detail::FlatBuffer grads;  // whole gradients during backward (null between steps)
    Tensor reduced;  // this step's averaged shard gradient, added to shard.grad at the end
    dist::Work reduce;
    bool reducing = false;
  };
  struct Unit {
    std::string name;
    std::vector<nn::Module*> modules;
    std::vector<Flat> flats;
    int64_t forward_start_ns = 0;
    bool root = false;
  };

  FSDPOptions options;
  dist::Group group;
  std::vector<std::string> names;
  std::vector<Tensor> params;
  std::vector<int> unit_of;
  std::vector<Unit> units;  // the root unit last
  std::vector<int> forward_order;
  bool order_known = false;
  std::vector<HookHandle> module_hooks;
  std::shared_ptr<detail::GradReadiness> readiness;
  std::vector<int> reducing;         // units with reduce_scatters in flight, oldest first
  bool end_queued = false;           // this backward's end-of-backward work is queued
  std::vector<char> backward_began;  // this step's units whose backward began
  std::vector<char> forward_began;   // this forward's units whose pre-forward ran
  FSDPStats stats;
  bool finite = true;  // the last synchronizing backward's verdict (check_finite)
  std::unique_ptr<nn::Module> shard_module;

  explicit State(FSDPOptions o)
      : options(std::move(o)), group(detail::data_parallel_group(options.group, kFSDPOp)) {}

  bool full_shard() const { return options.sharding == ShardingStrategy::FullShard; }
  std::vector<Tensor> members(const Flat& f) const {
    std::vector<Tensor> out;
    for (int i : f.params) out.push_back(params[size_t(i)]);
    return out;
  }
  Unit& root() { return units.back(); }

  // ---- gathering ---------------------------------------------------------------------------

  bool needs_gather(const Flat& f) const {
    return f.full.flat.storage()->released() || f.gathered_version != f.shard.version();
  }

  void launch_gather(Unit& u, bool prefetch) {
    for (Flat& f : u.flats) {
      if (f.gathering || !needs_gather(f)) continue;
      f.refill = f.gathered_version == f.shard.version();
      f.version_before = f.full.flat.storage()->version();
      f.full.flat.storage()->allocate_again();
      f.gathered_version = f.shard.version();
      NoGradGuard no_grad;
      f.gather = dist::all_gather(f.full.flat, f.shard.detach(), group, /*async_op=*/true);
      f.gathering = true;
      ++stats.gathers;
      if (prefetch) ++stats.prefetches;
    }
  }

  void wait_gather(Unit& u) {
    for (Flat& f : u.flats)
      if (f.gathering) {
        f.gathering = false;
        f.gather.wait();
        if (f.refill) f.full.flat.storage()->restore_version(f.version_before);
      }
  }

  void ensure_gathered(Unit& u) {
    launch_gather(u, false);
    wait_gather(u);
  }

  void release(Unit& u) {
    if (!full_shard()) return;
    wait_gather(u);
    for (Flat& f : u.flats) f.full.flat.storage()->release();
  }

  // ---- forward -------------------------------------------------------------------------------

  int next_in_forward(int u, int direction) const {
    if (!order_known) return direction > 0 && u + 1 < int(units.size()) - 1 ? u + 1 : -1;
    auto it = std::find(forward_order.begin(), forward_order.end(), u);
    if (it == forward_order.end()) return -1;
    const auto pos = it - forward_order.begin() + direction;
    return pos >= 0 && pos < int64_t(forward_order.size()) ? forward_order[size_t(pos)] : -1;
  }

  void pre_forward(int u) {
    Unit& unit = units[size_t(u)];
    ensure_gathered(unit);
    if (recomputing()) return;
    forward_began[size_t(u)] = 1;
    if (!order_known &&
        std::find(forward_order.begin(), forward_order.end(), u) == forward_order.end())
      forward_order.push_back(u);
    if (options.prefetch) {
      const int next = next_in_forward(u, +1);
      if (next >= 0) launch_gather(units[size_t(next)], true);
    }
    if (trace::enabled()) unit.forward_start_ns = trace::detail::now_ns();
  }

  Tensor post_forward(int u, const Tensor& output) {
    Unit& unit = units[size_t(u)];
    if (recomputing()) return output;  // its backward follows at once: keep it gathered
    if (trace::enabled())
      trace::detail::record("fsdp", fmt::format("forward unit {}", u), unit.forward_start_ns,
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

  // The checkpointed region of a unit runs again inside backward (autograd::checkpoint): its
  // hooks gather but neither prefetch in forward order nor release.
  static bool recomputing() { return autograd::detail::recomputing(); }

  // ---- backward ------------------------------------------------------------------------------

  void pre_backward(int u) {
    queue_end_of_backward();
    gather_for_backward(u);
    bind_grads(units[size_t(u)]);
  }

  // The collectives a unit's backward begins with: its gather, and the previous unit's prefetch.
  void gather_for_backward(int u) {
    backward_began[size_t(u)] = 1;
    ensure_gathered(units[size_t(u)]);
    if (options.prefetch) {
      const int previous = next_in_forward(u, -1);
      if (previous >= 0) launch_gather(units[size_t(previous)], true);
    }
  }

  // The forward order, completed with the units it lacks in index order (a first forward that
  // stopped early has seen only some; its peers run the model's children in order).
  std::vector<int> completed_forward_order() const {
    std::vector<int> order = forward_order;
    for (int u = 0; u + 1 < int(units.size()); ++u)
      if (std::find(order.begin(), order.end(), u) == order.end()) order.push_back(u);
    return order;
  }

  // A rank whose backward stopped early issues what the others still issue, in their order: for
  // each unit whose backward had not begun (last forward first), its gathers, then (when
  // `reduce`) its gradients complete (zeros), which launches its reduce_scatter in the fixed
  // order.
  void replay_rest_of_backward(bool reduce = true) {
    const std::vector<int> order = completed_forward_order();
    for (auto it = order.rbegin(); it != order.rend(); ++it) {
      if (!backward_began[size_t(*it)]) gather_for_backward(*it);
      if (!reduce) continue;
      for (const Flat& f : units[size_t(*it)].flats)
        for (int i : f.params) readiness->mark_ready(i);
    }
  }

  // What the rest of a forward issues: each unit not begun yet gathers (and prefetches the
  // next), then every unit is released as its forward would have released it.
  void replay_rest_of_forward() {
    forward_order = completed_forward_order();
    order_known = true;
    for (int u : forward_order) {
      if (!forward_began[size_t(u)]) pre_forward(u);
      release(units[size_t(u)]);
    }
  }

  // This rank's forward raised, its peers' did not: issue what the rest of their forward and
  // their backward issue (synchronizing: the reduce_scatters and the settling all_reduce, the
  // step failed; no_sync: the backward's gathers only; grad mode off: no backward follows), so
  // every collective still pairs and the next step starts in step.
  void abandon_forward(bool synchronizing) {
    replay_rest_of_forward();
    if (synchronizing) {
      readiness->clear();
      settle(/*failed=*/true);  // releases every unit
      return;
    }
    if (autograd::GradMode::is_enabled()) replay_rest_of_backward(/*reduce=*/false);
    for (Unit& u : units) release(u);
  }

  // Whole-gradient buffers for the unit, the parameters' .grad bound into them so backward
  // accumulates in place (what no_sync micro-batches accumulated is kept).
  void bind_grads(Unit& unit) {
    for (Flat& f : unit.flats) {
      if (!f.grads.flat.defined()) f.grads = detail::FlatBuffer::like(members(f), group.size());
      for (size_t k = 0; k < f.params.size(); ++k)
        detail::bind_grad(params[size_t(f.params[k])], f.grads.view(k));
    }
  }

  // Launched in the fixed unit order (GradReadiness): every rank issues the same collectives.
  void launch_reduce(int u) {
    Unit& unit = units[size_t(u)];
    bind_grads(unit);  // parameters without a gradient contribute zeros
    NoGradGuard no_grad;
    for (Flat& f : unit.flats) {
      f.reduced = empty(f.shard.shape(), {.dtype = f.shard.dtype(), .device = f.shard.device()});
      f.reduce = dist::reduce_scatter(f.reduced, f.grads.flat, dist::ReduceOp::Avg, group,
                                      /*async_op=*/true);
      f.reducing = true;
      ++stats.reduce_scatters;
    }
    // At most two units' whole gradients are alive: the one just launched, and the one before
    // while its reduce-scatter completes (it overlapped this unit's backward).
    for (int earlier : reducing) finish_reduce(units[size_t(earlier)]);
    reducing.assign(1, u);
    if (!unit.root) release(unit);
  }

  void finish_reduce(Unit& unit) {
    for (Flat& f : unit.flats) {
      if (!f.reducing) continue;
      f.reducing = false;
      f.reduce.wait();
      for (int i : f.params) params[size_t(i)].set_grad(Tensor());
      f.grads = {};
    }
  }

  void queue_end_of_backward() {
    if (end_queued) return;
    end_queued = true;
    std::weak_ptr<State> weak = self;
    autograd::queue_final_callback([weak](bool) {
      if (auto s = weak.lock()) s->end_of_backward();
    });
  }

  // Releases the parameters after a no_sync backward. A synchronizing one leaves that to
  // settle(), which may still need them gathered as they are (it replays a failed backward).
  void end_of_backward() {
    end_queued = false;
    if (readiness->backward_expected()) return;
    for (Unit& u : units) release(u);
  }

  // Ends a synchronizing step on this rank, in step with the group.
  void settle(bool failed) {
    const int64_t step = stats.steps++;
    if (failed) replay_rest_of_backward();
    readiness->launch_rest();
    Tensor flag = full({1}, failed ? 1.0 : 0.0, {.dtype = kInt64});
    dist::all_reduce(flag, dist::ReduceOp::Sum, group);
    const int64_t failed_ranks = flag.item<int64_t>();
    for (int u : reducing) finish_reduce(units[size_t(u)]);
    reducing.clear();
    NoGradGuard no_grad;
    if (failed_ranks == 0 && options.check_finite) finite = agree_finite();
    if (failed_ranks == 0)
      for (Unit& u : units)
        for (Flat& f : u.flats) {
          if (f.shard.grad().defined())
            f.shard.grad().add_(f.reduced);
          else
            f.shard.set_grad(f.reduced);
        }
    for (Unit& u : units) {
      for (Flat& f : u.flats) f.reduced = Tensor();
      release(u);
    }
    if (failed_ranks > 0) ++stats.failed_steps;
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

  // join(): the step the others take, with zero gradients from this rank, settled with them.
  void shadow_step() {
    // Its gradients are this step's average alone, as a training rank's after zero_grad.
    for (Unit& u : units)
      for (Flat& f : u.flats) f.shard.set_grad(Tensor());
    dist::set_step(group, stats.steps);
    forward_began.assign(units.size(), 0);
    backward_began.assign(units.size(), 0);
    ensure_gathered(root());
    replay_rest_of_forward();
    readiness->clear();
    replay_rest_of_backward();
    settle(/*failed=*/false);
  }

  // Whether every rank's averaged shard gradients are finite: each checks its own, and the
  // group agrees in one all_reduce.
  bool agree_finite() {
    std::vector<Tensor> reduced;
    for (const Unit& u : units)
      for (const Flat& f : u.flats) reduced.push_back(f.reduced);
    Tensor bad = full({1}, all_finite(reduced) ? 0.0 : 1.0, {.dtype = kInt64});
    dist::all_reduce(bad, dist::ReduceOp::Max, group);
    return bad.item<int64_t>() == 0;
  }

  std::weak_ptr<State> self;
};

}  // namespace weave::parallel

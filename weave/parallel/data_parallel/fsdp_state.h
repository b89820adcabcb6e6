#pragma once
// FullyShardedDataParallel's state and hooks (internal; PyTorch FSDP2's FSDPState): the units
// (fsdp_unit.h), the order they run in, and what the module's hooks and the backward's
// callbacks do at each phase of a step. fsdp.cpp builds it and wires it to the module;
// fsdp_state_dict.cpp reads and writes the parameters through it.
#include <memory>
#include <string>
#include <vector>

#include "weave/parallel/core/readiness.h"
#include "weave/parallel/data_parallel/fsdp.h"
#include "weave/parallel/data_parallel/fsdp_unit.h"

namespace weave::parallel {

/// The name FSDP's errors carry.
inline constexpr const char* kFSDPOp = "FullyShardedDataParallel";

struct FullyShardedDataParallel::State {
  using Unit = detail::FSDPUnit;
  using Flat = detail::FSDPFlat;

  FSDPOptions options;
  dist::Group group;
  std::vector<std::string> names;
  std::vector<Tensor> params;
  std::vector<int> unit_of;        // each parameter's unit
  detail::ReplicaGroups replicas;  // where each parameter is sharded: experts apart
  std::vector<Unit> units;         // the root unit last
  std::vector<int> forward_order;
  bool order_known = false;  // forward_order is complete (a synchronizing forward ran)
  std::vector<HookHandle> module_hooks;
  std::shared_ptr<detail::GradReadiness> readiness;
  // FSDPOptions::reproducible: every micro-batch's end folds each flat's gradients.
  std::unique_ptr<detail::BackwardEnds> microbatch_ends;
  std::vector<int> reducing;  // units with reduce_scatters in flight, oldest first
  // Units whose gradients are reduced but whose frozen parameters this backward may still read
  // (its last gradient can come before a frozen weight's last use): released at the next unit's
  // backward, when every node of theirs has run.
  std::vector<int> release_after;
  bool end_queued = false;  // this backward's end-of-backward work is queued
  FSDPStats stats;
  bool finite = true;  // the last synchronizing backward's verdict (check_finite)
  /// dist::disagreements(group) when the group was last known to be in step.
  uint64_t disagreements_seen = 0;
  std::unique_ptr<nn::Module> shard_module;  // state_dict's view of the shards, made on demand
  std::weak_ptr<State> self;

  explicit State(FSDPOptions o);

  bool full_shard() const { return options.sharding == ShardingStrategy::FullShard; }
  Unit& root() { return units.back(); }
  /// Every flat's shard by its name ("unit0_float32", "unit1_float32_frozen"), in unit order.
  nn::NamedTensors named_shards() const;
  /// Every unit starts a new forward (and, `with_backward`, a new step's backward).
  void new_forward(bool with_backward) {
    for (Unit& u : units) u.new_forward(with_backward);
  }
  void ensure_gathered(Unit& u) { u.ensure_gathered(stats); }
  void release(Unit& u) { u.release(full_shard()); }
  void bind_grads(Unit& u) { u.bind_grads(params); }

  // ---- forward: the module hooks ---------------------------------------------------------------
  /// The unit after (direction +1) or before (-1) u in forward order, or -1.
  int next_in_forward(int u, int direction) const;
  void pre_forward(int u);
  Tensor post_forward(int u, const Tensor& output);

  // ---- backward: the output hooks and the readiness callbacks ----------------------------------
  void pre_backward(int u);
  /// The collectives a unit's backward begins with: its gather, and the previous unit's
  /// prefetch.
  void gather_for_backward(int u);
  /// Launched in the fixed unit order (GradReadiness): every rank issues the same collectives.
  void launch_reduce(int u);
  void queue_end_of_backward();
  /// Releases the parameters after a no_sync backward. A synchronizing one leaves that to
  /// settle(), which may still need them gathered as they are (it replays a failed backward).
  void end_of_backward();
  /// Ends a synchronizing step on this rank, in step with the group.
  void settle(bool failed);
  /// FSDPOptions::reproducible: every flat's sums reduced into `reduced` (the step kept), or
  /// dropped (it failed).
  void reduce_reproducibly(bool keep);

  // ---- a rank out of step ----------------------------------------------------------------------
  /// The forward order, completed with the units it lacks in index order (a first forward that
  /// stopped early has seen only some; its peers run the model's children in order).
  std::vector<int> completed_forward_order() const;
  /// A rank whose backward stopped early issues what the others still issue, in their order:
  /// for each unit whose backward had not begun (last forward first), its gathers, then (when
  /// `reduce`) its gradients complete (zeros), which launches its reduce_scatter in the fixed
  /// order.
  void replay_rest_of_backward(bool reduce = true);
  /// What the rest of a forward issues: each unit not begun yet gathers (and prefetches the
  /// next), then every unit is released as its forward would have released it.
  void replay_rest_of_forward();
  /// This rank's forward raised, its peers' did not: issue what the rest of their forward and
  /// their backward issue, so every collective still pairs and the next step starts in step.
  void abandon_forward(bool synchronizing);
  /// join(): the step the others take, with zero gradients from this rank, settled with them.
  void shadow_step();

 private:
  /// Whether every rank's averaged shard gradients are finite: each checks its own, and the
  /// group agrees in one all_reduce.
  bool agree_finite();
  /// A call on the group failed its agreement check since it was last in step.
  bool diverged() const;
  /// What the step still issues (a failed rank's replay, the buckets not launched, the waits on
  /// the reduce_scatters in flight), unless the group diverged; returns whether it did.
  bool finish_step_collectives(bool failed);
  /// The ranks that failed the step, summed in one all_reduce; a diverged group realigns
  /// first, and every rank of it counts as failed.
  int64_t count_failed_ranks(bool failed);
  void finish_reduce(Unit& u) { u.finish_reduce(params); }
};

}  // namespace weave::parallel

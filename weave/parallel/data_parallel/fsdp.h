#pragma once
// Fully sharded data parallelism (PyTorch's FSDP, DeepSpeed's ZeRO-2 and ZeRO-3): each of the N
// ranks of the group keeps 1/N of the parameters, of their gradients and of the optimizer state,
// and sees whole parameters only while a unit of the model runs.
//
//   parallel::FullyShardedDataParallel fsdp(model);       // units: model.shard_units()
//   optim::AdamW adamw(fsdp.parameters(), {.lr = 1e-3});  // steps this rank's shards only
//   for (auto& batch : loader) {
//     adamw.zero_grad();
//     cross_entropy(fsdp(batch.input), batch.target).backward();  // averaged, sharded grads
//     adamw.step();
//   }
//
// The group is the ranks that read different batches (mesh.data_and_context() under context
// parallelism). Experts spread over a sub-axis of it (ExpertParallelMoE over mesh.expert()) are
// flattened apart, sharded over the ranks holding the same experts, and their averaged gradient
// scaled by 1 / (expert group size), as DDP does (placement.h). Tensor-parallel layers inside
// compose: each rank shards its slices over the group.
//
// Units. The model is cut into units (named submodules: the model's own shard_units() by
// default, else each direct child with parameters, or children grouped up to a size). A unit's
// parameters, per dtype, are flattened and padded to a multiple of N; rank r keeps slice r, a leaf
// of its own: parameters() lists these shards, and the optimizer steps them. Parameters of no unit,
// and parameters shared by several units, form the root unit, gathered for the whole forward and
// backward. Frozen parameters (requires_grad false: a base under low-rank adapters, nn/lora.h) are
// flattened apart and sharded alike, gathered for compute, but hold no gradient buffer, are never
// reduce-scattered and are not in parameters(): the optimizer holds no state for them.
//
// A step, for unit i (ZeRO-3, FullShard):
//   forward   all_gather unit i (already in flight: it was prefetched while unit i-1 ran), and
//             start unit i+1's all_gather; run unit i; release unit i's gathered memory
//             (reshard_after_forward)
//   backward  at unit i's output: all_gather unit i again (prefetched at unit i+1's), start unit
//             i-1's; as unit i's last gradient is accumulated, reduce_scatter its gradients
//             (averaged) into the shards' .grad and release the gathered parameters and the
//             full gradients
// With ShardGradOp (ZeRO-2) the gathered parameters stay (they are gathered again only after
// the optimizer changed the shards); gradients and optimizer state are sharded the same way.
//
// Memory per rank (ZeRO-3): (parameters + gradients + optimizer state) / N, plus the gathered
// parameters and gradients of the units in flight (two with prefetch), plus activations.
// Activation checkpointing (nn::Checkpoint around the units) composes: the recomputation runs
// inside the unit's backward, while the unit is gathered.
//
// Every rank of the group runs the same model code (the collectives pair up by order), with the
// same options and units (checked at construction). A rank whose forward raises still issues
// what its peers' forward and backward issue, before its error leaves forward; a rank whose
// backward fails part-way still issues what its peers' backward issues, in their order (each
// remaining unit's gathers, then its reduce_scatter of zeros); a rank that skips backward does
// so at its next forward, with a warning. One small all_reduce at the end tells every rank,
// every rank discards the step's gradients, and the ranks that did not fail raise. Each step is
// numbered on the group (dist::set_step), so ranks in different steps raise instead of pairing.
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "weave/distributed/distributed.h"
#include "weave/nn/module.h"
#include "weave/optim/optimizer.h"
#include "weave/parallel/core/data_parallel_wrapper.h"
#include "weave/parallel/core/joinable.h"
#include "weave/parallel/core/no_sync.h"

namespace weave::parallel {

enum class ShardingStrategy {
  /// ZeRO-3: parameters, gradients and optimizer state sharded.
  FullShard,
  /// ZeRO-2: gradients and optimizer state sharded; every rank keeps the whole parameters.
  ShardGradOp,
};

struct FSDPOptions {
  ShardingStrategy sharding = ShardingStrategy::FullShard;
  /// Submodules to make units, by name ("blocks.0", as parameter names prefix them). Empty: the
  /// module's own shard_units() (the library's models: each block, the embeddings, the norm and
  /// the head), else, and whenever unit_mb is set, every direct child that has parameters
  /// (grouped by unit_mb). Named units must not contain one another.
  std::vector<std::string> units = {};
  /// With no units named: consecutive direct children are grouped into one unit until their
  /// parameters reach this many MB (0: one unit per child).
  double unit_mb = 0;
  /// FullShard: release a unit's gathered parameters after its forward (gathered again in
  /// backward). Off trades memory for one all_gather per unit and step.
  bool reshard_after_forward = true;
  /// Start the all_gather of the next unit (forward) or previous unit (backward) while this one
  /// computes.
  bool prefetch = true;
  /// The ranks that shard the model (default: the world; under a ProcessMesh, mesh.data()).
  std::optional<dist::Group> group = std::nullopt;
  /// HSDP (hybrid sharding, as torchtitan's and DeepSpeed's across nodes): the ranks that hold
  /// the same shards as this one, one in each shard group (`group`). FSDP shards over `group`
  /// and averages every shard's gradient over this group too, launched as each unit's
  /// reduce-scatter completes (overlapping the rest of backward); the replicas start equal (a
  /// broadcast from its first rank, or a deferred model's draws, whose seed the replicas agree
  /// on) and discard a step together. The groups must be a replicate x shard grid of the data
  /// ranks (each replicate group one rank at the same place of every shard group), and the
  /// options the same across replicas: construction raises on every rank otherwise.
  /// Clipping, the replica check and sharded checkpoints read it from the shards' placement
  /// like any other axis. Both groups come from dist::split_group over the data ranks:
  ///
  ///   // 4 ranks: shard groups {0, 1} and {2, 3}, replicate groups {0, 2} and {1, 3}
  ///   const dist::Group shard = dist::split_group(dist::world(), {{0, 1}, {2, 3}});
  ///   const dist::Group replicas = dist::split_group(dist::world(), {{0, 2}, {1, 3}});
  ///   parallel::FullyShardedDataParallel hsdp(model, {.group = shard,
  ///                                                   .replicate_group = replicas});
  std::optional<dist::Group> replicate_group = std::nullopt;
  /// Broadcast the parameters and buffers from this group rank at construction.
  int broadcast_from = 0;
  /// Mixed precision (PyTorch FSDP2's MixedPrecisionPolicy): the dtype the gathered parameters
  /// take, and so the units' compute; forward casts its floating main input to it too. The
  /// shards, what the optimizer steps, keep the parameters' own dtype: float32 master weights
  /// under bfloat16 compute, and half the gathered bytes. None: the parameters' dtype.
  std::optional<DType> param_dtype = std::nullopt;
  /// The dtype the gradients are reduce-scattered in (float32 sums bfloat16 gradients without
  /// their rounding; the low dtype halves the bytes). None: param_dtype, else the parameters'.
  std::optional<DType> reduce_dtype = std::nullopt;
  /// The dtype forward's floating output is cast to (float32 keeps a loss on bfloat16 logits
  /// from rounding to bfloat16). None: as the model computed it.
  std::optional<DType> output_dtype = std::nullopt;
  /// CPU offload (FSDP2's CPUOffloadPolicy), for CUDA parameters: the shards, their gradients
  /// and so the optimizer's state live in host memory, and the optimizer steps on the host.
  /// Each gather copies the shard to the device before its all_gather; each averaged gradient
  /// shard is copied back. The device holds only the units in flight and the activations.
  /// Raises for parameters that are not on a CUDA device.
  bool offload_to_cpu = false;
  /// After each synchronizing backward, check the averaged shard gradients for NaN and
  /// infinity. Each rank holds other shards, so the ranks agree on one verdict (one small
  /// all_reduce): every rank raises weave::Error from backward (gradients left as averaged),
  /// and gradients_finite() says false until the next synchronizing backward.
  bool check_finite = false;
  /// Sum the gradients reproducibly (DDPOptions::reproducible, docs/reproducibility.md): each
  /// backward's gradients join binned sums per element (each unit's as soon as they are
  /// complete), and the synchronizing backward reduce-scatters those sums as integers (and adds
  /// them over the replicas under HSDP), so each shard's gradient is the mean over every rank's
  /// micro-batches of the step with the same bits at any number of ranks; clip_grad_norm_ on
  /// the shards sums exactly. The sums cost 17 bytes per element of the whole model on every
  /// rank. Refuses parameters cut across ranks and offload_to_cpu.
  bool reproducible = false;
};

/// What the wrapper did (for tests and benchmarks).
struct FSDPStats {
  /// all_gathers and reduce_scatters issued so far, over all units.
  int64_t gathers = 0;
  int64_t reduce_scatters = 0;
  /// Of the gathers, those started ahead of need (prefetches).
  int64_t prefetches = 0;
  /// Synchronizing backward passes settled so far, and those discarded because a rank failed.
  int64_t steps = 0;
  int64_t failed_steps = 0;
  /// Bytes the all_gathers delivered into units (each gather's whole buffer), and the bytes
  /// the reduce-scatters sent (each whole gradient buffer, in the reduce dtype).
  int64_t gathered_bytes = 0;
  int64_t reduced_bytes = 0;
};

class FullyShardedDataParallel : public Joinable, public DataParallelWrapper {
 public:
  /// Checks that every rank of the group (and of the replicate group) has the same model (a
  /// deferred one under the same seed; raising on every rank, naming the first difference) and
  /// the same options and units, broadcasts the parameters and buffers from
  /// options.broadcast_from, then shards them: from here on the module's parameters hold their
  /// values only while their unit runs (FullShard). Collective over the group. The module must
  /// outlive this object.
  explicit FullyShardedDataParallel(nn::Module& module, FSDPOptions options = {});
  ~FullyShardedDataParallel();
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  /// The module's forward (side inputs too: a Tensor converts to nn::Inputs).
  Tensor forward(const nn::Inputs& inputs) override;
  Tensor operator()(const nn::Inputs& inputs) { return forward(inputs); }
  nn::Module& module() override { return module_; }
  /// Runs `body`, which calls the module other than through forward (decoding with KV caches:
  /// model.decode, whose blocks gather between their hooks), with the root unit gathered and
  /// gradients off; every unit is released after. Collective: every rank of the group makes
  /// the same calls.
  ///
  ///   fsdp.run([&] { logits = model.decode(ids, caches); });
  void run(const std::function<void()>& body) override;

  /// This rank's shards of what trains (one flat leaf per unit and dtype): what the optimizer
  /// steps. Frozen parameters' shards are not among them.
  std::vector<Tensor> parameters() const;
  /// "unit0_float32" for each of parameters(): unit index (unit_names() order) and dtype, with
  /// "_experts" for a unit's spread experts; sharded_module() names its parameters so, and the
  /// frozen parameters' shards "unit0_float32_frozen".
  std::vector<std::string> shard_names() const;
  /// Unit names, in order ("" for the root unit).
  std::vector<std::string> unit_names() const;

  /// While the guard lives, backward accumulates whole gradients locally (no reduce_scatter);
  /// the first backward after it reduces everything accumulated.
  NoSyncGuard no_sync() override;

  /// The whole model's parameters and buffers, by the module's names, gathered on every rank
  /// (copies). Collective.
  nn::NamedTensors full_state_dict() override;
  /// Loads whole parameters (each rank keeps its slices) and buffers; strict as
  /// Module::load_state_dict. Collective (it checks on every rank before changing anything).
  void load_full_state_dict(const nn::NamedTensors& state);
  /// The optimizer's parameter groups for the shards. `groups` list the model's own parameters
  /// (optim::weight_decay_groups(model, wd) makes the usual split); each shard joins the groups
  /// of the parameters it holds elements of, for those elements. Every parameter of the model
  /// must be in one group, or this raises naming it.
  ///
  ///   optim::AdamW adamw(fsdp.param_groups(optim::weight_decay_groups(model, 0.1)), {...});
  std::vector<optim::ParamGroup> param_groups(
      const std::vector<optim::ParamGroup>& groups) const override;

  /// A module whose parameters are this rank's shards (and whose buffers are the model's), for
  /// data::TrainingState: sharded checkpoints save it with what each shard holds, and load it
  /// (or a checkpoint of any other layout of the same model) at any world size.
  nn::Module& sharded_module() override;

  /// Clips the gradients of this rank's shards so that the norm of the whole model's gradients
  /// (every rank's shard counted once, as FSDP1's clip_grad_norm_) is at most max_norm; returns
  /// that norm before clipping, the same on every rank. norm_type is any p >= 1 or INFINITY.
  /// Collective over the group (one all_reduce): parallel::clip_grad_norm_(parameters(), ...)
  /// over the group, which must hold the whole model; around tensor-parallel layers call that
  /// over the world instead. optim::clip_grad_norm_ on the shards raises: each rank's own norm
  /// is not the model's.
  ///
  ///   cross_entropy(fsdp(x), y).backward();
  ///   fsdp.clip_grad_norm_(1.0);
  ///   adamw.step();
  double clip_grad_norm_(double max_norm, double norm_type = 2.0, bool error_if_nonfinite = false);

  const FSDPStats& stats() const;
  /// With check_finite: false when the last synchronizing backward averaged a NaN or infinite
  /// gradient into some rank's shard (the same answer on every rank).
  bool gradients_finite() const override;
  const dist::Group& group() const override;
  /// parameters(): the shards are what trains.
  std::vector<Tensor> trained_parameters() const override { return parameters(); }
  /// The shard of a flat that holds `parameter` alone, unsharded (a vocabulary piece split
  /// across batches: ModelSplit::vocabulary); undefined for every other parameter.
  Tensor trained_tensor_of(const Tensor& parameter) const override;

  struct State;

 private:
  // join(): this rank can take part in a step with zero gradients once it has run a forward
  // (it knows the units' order); that step is the forward's gathers, then the backward's
  // gathers and reduce_scatters of zeros. A step whose forward ran here but whose backward
  // will not is settled as failed with the group.
  const dist::Group& join_group() const override { return group(); }
  bool can_shadow_join_step() const override;
  void shadow_join_step() override;
  void abandon_join_step() override;

  nn::Module& module_;
  std::shared_ptr<State> state_;
};

}  // namespace weave::parallel

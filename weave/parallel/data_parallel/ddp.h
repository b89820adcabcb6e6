#pragma once
// Data parallelism: every rank holds the whole model, trains on its own share of each batch,
// and averages gradients during backward.
//
//   nn::Sequential model{...};
//   parallel::DistributedDataParallel ddp(model);         // broadcasts rank 0's parameters
//   optim::AdamW opt(model.parameters());
//   for (auto& batch : loader) {
//     Tensor loss = cross_entropy(ddp(batch.input), batch.target);
//     opt.zero_grad(/*set_to_none=*/false);                 // keeps gradients in the buckets
//     loss.backward();                                      // returns with averaged gradients
//     opt.step();
//   }
//
// Gradients are gathered into buckets (the first about 1 MB, later ones about 25 MB) in the
// order backward produces them, traced in the first backward and checked to be identical on
// every rank. As soon as a bucket's last gradient is accumulated, its averaging all_reduce is
// launched asynchronously while backward goes on; the end of backward waits for the rest.
// Gradients live as views of the bucket buffers, so nothing is copied in or out (with
// zero_grad(set_to_none = true) a gradient arrives in a fresh buffer and is copied in once).
//
// Each parameter is averaged where its placement (placement.h) says its copies are. The group is
// the ranks that read different batches: mesh.group({Axis::Data, Axis::Context}) under context
// parallelism, where the replicated parameters' gradients average over both. Experts spread over
// a sub-axis of it (ExpertParallelMoE over mesh.expert()) are averaged apart, in buckets of their
// own, over the ranks holding the same experts, times 1 / (expert group size): their gradient
// already sums the tokens of the whole expert group (Megatron's expert-data groups and expert
// scale). Tensor-parallel slices, flat shards and pipeline stages must lie across the group
// (one piece per rank of it), or construction raises on every rank.
//
//   parallel::ProcessMesh mesh({.data = 2, .context = 2, .expert = 2});   // 4 ranks
//   options.reduce_shares = parallel::shares_over(mesh.data_and_context());
//   parallel::ExpertParallelMoE moe(options, mesh.expert());
//   parallel::DistributedDataParallel ddp(model, {.find_unused_parameters = true,  // routing
//                                                 .group = mesh.data_and_context()});
//
// A pipeline stage under DDP: pass the wrapper to parallel::Pipeline in place of the stage (it
// is a DataParallelWrapper); the pipeline runs every micro-batch but the last under no_sync().
//
// Every synchronizing step ends the same way on every rank of the group. The last bucket carries
// two status words (this rank's backward failed; this rank has parameters without gradient), so
// what one rank knows every rank learns in the same all_reduce:
//  - an exception that unwinds one rank's backward (a hook, a custom Function, an allocation)
//    still completes that rank's share of the all_reduces; every rank discards the step's
//    gradients (zeroes them), the failing rank's error propagates, and every other rank raises
//    "... failed or skipped backward in step N". A loop that catches the error and goes on to
//    the next batch (after zero_grad) trains as if every rank had skipped that batch.
//  - a rank whose synchronizing forward is followed by another forward instead of a backward
//    (it skipped the backward) settles the step at that next forward, as failed, the same way.
//  - a parameter without gradient on any rank (without find_unused_parameters) raises on every
//    rank, each naming its own.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "weave/distributed/distributed.h"
#include "weave/nn/module.h"
#include "weave/parallel/core/data_parallel_wrapper.h"
#include "weave/parallel/core/joinable.h"
#include "weave/parallel/core/no_sync.h"
#include "weave/parallel/core/replicas.h"

namespace weave::parallel {

struct DDPOptions {
  /// Size cap of the first bucket (launched earliest, so communication starts soon).
  double first_bucket_mb = 1.0;
  /// Size cap of the later buckets.
  double bucket_mb = 25.0;
  /// Allow parameters that get no gradient in a step (their share of the bucket reduces
  /// zeros). Without it, such a parameter is an error naming it, raised at the end of
  /// backward after the communication completed (so no peer is left waiting).
  bool find_unused_parameters = false;
  /// Communicate gradients in kBFloat16 or kFloat16 (averaged, then widened back into the
  /// parameters' dtype), or in kFloat32 (bfloat16/float16 parameters averaged in float32,
  /// then rounded once). Unset: the parameters' own dtype.
  std::optional<DType> compress = std::nullopt;
  /// The ranks that share the model (default: the world).
  std::optional<dist::Group> group = std::nullopt;
  /// Broadcast the parameters and buffers from this group rank at construction.
  int broadcast_from = 0;
  /// Broadcast the module's buffers (running statistics and the like, which forward may update
  /// differently on each rank) from broadcast_from before every synchronizing forward, as
  /// PyTorch does. Costs nothing for a module without buffers.
  bool broadcast_buffers = true;
  /// After averaging, check the gradients for NaN and infinity. The averaged gradients are the
  /// same on every rank, so every rank reaches the same verdict without communicating: each
  /// raises weave::Error from backward (gradients left as averaged), and
  /// gradients_finite() says false until the next synchronizing backward.
  bool check_finite = false;
  /// Sum the gradients so that their bits do not depend on the number of ranks or on how the
  /// micro-batches are spread over them (a run at 1, 2, 3 or 4 ranks, or one resumed at fewer,
  /// steps alike): each micro-batch's gradient (one backward) goes into a binned sum per
  /// element as that backward ends, and the ranks add those sums as integers. The gradient is then
  /// the mean over every micro-batch of the step on every rank (so do not divide the loss by
  /// the accumulation steps: each micro-batch's loss is its own mean). Needs micro-batches of
  /// one size (parallel::MicroBatchPlan deals them by global index), the same thread count on
  /// every rank and in every layout, and whole parameters (no tensor, context, expert,
  /// vocabulary or pipeline cuts), or construction raises on every rank. Costs 17 bytes of
  /// sums per parameter element and 17 bytes on the wire per element per step;
  /// parallel::clip_grad_norm_ then sums the norm exactly. docs/reproducibility.md.
  bool reproducible = false;
  /// Every this many synchronizing steps (0: never), the forward first compares a checksum of
  /// every parameter across the ranks that should hold equal copies of it (check_replicas over
  /// the group, reading placements), raising on every rank with the parameter and the ranks on
  /// each side: the net under a replica stepped, clipped or scaled on its own.
  int64_t check_replicas_every = 0;
};

/// What the last synchronizing backward did (for tests and benchmarks).
struct DDPStats {
  int buckets = 0;
  /// Gradients accumulated in that backward before the first bucket was launched, out of
  /// `parameters`: below `parameters` means communication overlapped the rest of backward.
  int64_t ready_before_first_launch = 0;
  int64_t parameters = 0;
  /// Parameters that got no gradient.
  std::vector<std::string> unused;
  /// Synchronizing backward passes settled so far (finished, failed or skipped).
  int64_t steps = 0;
  /// Of those, steps whose gradients were discarded because some rank's backward failed or
  /// was skipped.
  int64_t failed_steps = 0;
};

class DistributedDataParallel : public Joinable, public DataParallelWrapper {
 public:
  /// Checks that every rank of the group has the same parameter names, shapes and dtypes
  /// (raising weave::Error on every rank, naming the first difference; spread experts match by
  /// shape), then broadcasts the parameters and buffers from options.broadcast_from (each
  /// spread expert from the first rank holding it). Every rank of the group must
  /// construct it, with the module it will train (which must outlive this object).
  explicit DistributedDataParallel(nn::Module& module, DDPOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  /// The module's forward (side inputs too: a Tensor converts to nn::Inputs).
  Tensor forward(const nn::Inputs& inputs) override;
  Tensor operator()(const nn::Inputs& inputs) { return forward(inputs); }
  nn::Module& module() override { return module_; }

  /// While the guard lives, backward accumulates gradients locally without communicating
  /// (gradient accumulation); the first backward after it averages everything accumulated.
  NoSyncGuard no_sync() override;

  const DDPStats& stats() const;
  /// With check_finite: false when the last synchronizing backward averaged a NaN or infinite
  /// gradient (the same answer on every rank). A mixed-precision loss scaler reads this.
  bool gradients_finite() const override;
  /// Parameter names of each bucket, in launch order (empty before the first backward).
  std::vector<std::vector<std::string>> bucket_names() const;
  /// The ranks that share the model.
  const dist::Group& group() const override;
  /// The module's parameters: what the optimizer steps.
  std::vector<Tensor> trained_parameters() const override {
    return nn::trainable_parameters(module_);
  }

  struct State;

 private:
  // join(): this rank can take part in a step with zero gradients once the buckets are traced;
  // that step is the forward's buffer broadcast, then every bucket with zeros. At the end the
  // replicas' values are compared (an optimizer left out of join() leaves the idle rank's
  // behind). A step whose forward ran here but whose backward will not is settled as failed.
  const dist::Group& join_group() const override { return group(); }
  bool can_shadow_join_step() const override;
  void shadow_join_step() override;
  void check_join_ended() override;
  void abandon_join_step() override;

  nn::Module& module_;
  std::shared_ptr<State> state_;
};

}  // namespace weave::parallel

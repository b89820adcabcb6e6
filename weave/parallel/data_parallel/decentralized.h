#pragma once
// Decentralized data parallelism (Decent-DP): no global average per step. Each rank steps its
// own replica, then averages it with a few neighbours; over steps the replicas mix.
//
// Who averages with whom is a topology (parallel/topology.h): a cycle of phases, each a set of
// edges over the ranks of the group.
//
//   parallel::DecentralizedDataParallel ddp(model, [](std::vector<Tensor> bucket) {
//     return std::make_unique<optim::AdamW>(bucket, optim::AdamWOptions{.lr = 1e-3}); },
//     {.topology = "ring"});
//   for (auto& batch : loader) cross_entropy(ddp(batch.input), batch.target).backward();
//   ddp.global_avg();                    // at the end: every rank holds the average model
//
// Gradients are bucketed (traced in the first backward). When a bucket's gradients are all in,
// its own optimizer steps it inside backward, and the neighbour average of the bucket is
// launched asynchronously right away; the next forward waits for it, so communication overlaps
// the rest of backward and the time until the next forward.
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "weave/nn/module.h"
#include "weave/parallel/core/joinable.h"
#include "weave/parallel/core/replicas.h"
#include "weave/parallel/data_parallel/grad_scaler.h"
#include "weave/parallel/data_parallel/topology.h"

namespace weave::parallel {

struct DecentralizedOptions {
  std::string topology = "ring";
  /// Ranks per node, for alternating-exp-ring.
  int local_ranks = 1;
  double first_bucket_mb = 1.0;
  double bucket_mb = 25.0;
  /// Learning rate of step t (0-based), applied to every bucket's optimizer before it steps.
  std::function<double(int64_t step)> lr_schedule = nullptr;
  /// A loss scaler (not owned; float16 training): backward of scaler->scale(loss) arrives
  /// scaled; each bucket is unscaled before its optimizer steps it and is not stepped when
  /// it holds inf/NaN. Call scaler->update() after each backward: it agrees on the backoff
  /// over the world, so the scale stays the same on every rank.
  GradScaler* scaler = nullptr;
  /// The ranks that train together (default: the world; under a ProcessMesh, mesh.data()).
  /// Topology ranks are positions in this group. With a group smaller than the world, every
  /// rank of the world constructs its wrapper at the same time, on its own group of the same
  /// size (the sibling groups of a mesh): the edges of all of them are created together.
  std::optional<dist::Group> group = std::nullopt;
};

class DecentralizedDataParallel : public Joinable {
 public:
  /// Broadcasts group rank 0's model (after checking every rank of the group has the same one)
  /// and builds the topology's groups. `make_optimizer` builds the optimizer of one bucket's
  /// parameters. Collective over the world. After the first backward, each bucket's
  /// parameters live in one flat buffer (the neighbour average mixes it in one piece).
  DecentralizedDataParallel(nn::Module& module, OptimizerFactory make_optimizer,
                            DecentralizedOptions options = {});
  ~DecentralizedDataParallel();
  DecentralizedDataParallel(const DecentralizedDataParallel&) = delete;
  DecentralizedDataParallel& operator=(const DecentralizedDataParallel&) = delete;

  /// Completes the previous step's neighbour averages, then runs the module.
  Tensor forward(const nn::Inputs& inputs);
  Tensor operator()(const nn::Inputs& inputs) { return forward(inputs); }
  /// While on, backward only accumulates gradients (no step, no mixing); the first backward
  /// after turning it off steps with everything accumulated.
  void set_accumulate_grad(bool accumulate);
  /// Completes the pending neighbour averages (forward does this too).
  void wait();
  /// Completes pending averages, then averages the replicas over the group. Collective.
  void global_avg();
  /// Steps taken (backward passes that stepped).
  int64_t steps() const;
  /// Phases of the topology in use.
  const std::vector<TopologyPhase>& phases() const;
  const dist::Group& group() const;

  struct State;

 private:
  // join(): once the buckets are traced, a rank out of inputs takes part in each step's
  // neighbour averages with its parameters as they are; it has no gradients, so it does not
  // step (as a rank whose backward failed). The replicas differ by design: nothing is
  // compared at the end.
  const dist::Group& join_group() const override { return group(); }
  bool can_shadow_join_step() const override;
  void shadow_join_step() override;

  nn::Module& module_;
  std::shared_ptr<State> state_;
};

}  // namespace weave::parallel

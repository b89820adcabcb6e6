#pragma once
// Decentralized data parallelism (Decent-DP): no global average per step. Each rank steps its
// own replica, then averages it with a few neighbours; over steps the replicas mix.
//
// A topology is a cycle of phases. A phase is a set of edges (rank sets, each a group of its
// own) with a weight w; every rank is in exactly one edge per phase, and step t uses phase
// t mod (number of phases). On an edge R, rank i mixes
//   x_i <- w x_i + (1 - w) / (|R| - 1) * sum_{j in R, j != i} x_j
// (each phase's mixing matrix is doubly stochastic and symmetric).
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
#include <string>
#include <vector>

#include "weave/nn/module.h"
#include "weave/parallel/grad_scaler.h"
#include "weave/parallel/zero.h"

namespace weave::parallel {

/// One phase: edges (global ranks) with the phase's self-weight w.
struct TopologyPhase {
  std::vector<std::vector<int>> edges;
  double weight = 0.5;
};

/// A topology's phases for `world` ranks; `local_ranks` is the number of ranks per node
/// (alternating-exp-ring only). Names: "complete", "ring" (even world size), "one-peer-exp"
/// (power-of-two world size), "alternating-exp-ring" (local_ranks per node, a power-of-two
/// number of nodes). An unsupported world size raises weave::Error naming both.
std::vector<TopologyPhase> topology_phases(const std::string& name, int world, int local_ranks = 1);
/// The registered topology names.
std::vector<std::string> topology_names();
/// Registers a topology under `name` (for example, one of your own design).
void register_topology(
    const std::string& name,
    std::function<std::vector<TopologyPhase>(int world, int local_ranks)> make_phases);
/// The mixing matrix of one phase: M[i][j] is rank j's share in rank i's new value.
std::vector<std::vector<double>> mixing_matrix(const TopologyPhase& phase, int world);

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
};

class DecentralizedDataParallel {
 public:
  /// Broadcasts rank 0's model (after checking every rank has the same one) and builds the
  /// topology's groups. `make_optimizer` builds the optimizer of one bucket's parameters.
  /// Collective over the world.
  DecentralizedDataParallel(nn::Module& module, OptimizerFactory make_optimizer,
                            DecentralizedOptions options = {});
  ~DecentralizedDataParallel();
  DecentralizedDataParallel(const DecentralizedDataParallel&) = delete;
  DecentralizedDataParallel& operator=(const DecentralizedDataParallel&) = delete;

  /// Completes the previous step's neighbour averages, then runs the module.
  Tensor forward(const Tensor& input);
  Tensor operator()(const Tensor& input) { return forward(input); }
  /// While on, backward only accumulates gradients (no step, no mixing); the first backward
  /// after turning it off steps with everything accumulated.
  void set_accumulate_grad(bool accumulate);
  /// Completes the pending neighbour averages (forward does this too).
  void wait();
  /// Completes pending averages, then averages the replicas over all ranks. Collective.
  void global_avg();
  /// Steps taken (backward passes that stepped).
  int64_t steps() const;
  /// Phases of the topology in use.
  const std::vector<TopologyPhase>& phases() const;

  struct State;

 private:
  nn::Module& module_;
  std::shared_ptr<State> state_;
};

}  // namespace weave::parallel

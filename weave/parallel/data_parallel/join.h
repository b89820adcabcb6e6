#pragma once
// Uneven inputs (PyTorch's Join): the ranks of a data-parallel group may hold different numbers
// of batches. Inside join(), a rank whose training loop has returned shadows the steps the
// others still take, so no rank waits for a collective that never comes:
//
//   parallel::DistributedDataParallel ddp(model);
//   optim::AdamW optimizer(model.parameters());
//   parallel::join({ddp, optimizer}, [&] {
//     for (auto& batch : my_batches) {              // 65 on one rank, 64 on another
//       optimizer.zero_grad(/*set_to_none=*/false);
//       cross_entropy(ddp(batch.input), batch.target).backward();
//       optimizer.step();
//     }
//   });
//
// Each step of the first listed wrapper begins with one small all_reduce that counts the ranks
// still training. A rank whose loop has returned answers it with zero, then takes part in the
// step with zero gradients (DDP: the same bucket all_reduces; FSDP: the same gathers and
// reduce-scatters; ZeRO: the same reduce-scatter and all-gather; DistributedOptimizer: the same
// all_reduces) and steps what it received as the others do, so the replicas stay equal:
// parameters and optimizer state end where the others' end. Gradients are averaged over the
// whole group (PyTorch's divide_by_initial_world_size): a rank out of batches contributes
// zeros. join() returns on every rank once every rank's loop has returned.
//
// A loop that raises on one rank makes every other rank raise at its next step (a DDP step that
// failed on a training rank is skipped by the shadowing ones, as by the training ones); a DDP or
// FSDP step whose forward ran on the raising rank but whose backward did not is first settled
// with the group, as failed. A rank out of batches before its DDP wrapper's first backward (or
// its FSDP wrapper's first forward) cannot shadow it (the buckets or the units' order are not
// traced yet): every rank raises. Listing DDP without the optimizer that steps its parameters
// would leave the idle rank's replica behind: join() compares the replicas' values when it
// ends and raises on every rank if they differ.
#include <functional>
#include <type_traits>
#include <vector>

#include "weave/optim/optimizer.h"
#include "weave/parallel/core/joinable.h"

namespace weave::parallel {

/// One participant of join(), in the order its steps run inside the loop: a data-parallel
/// wrapper (every Joinable: DistributedDataParallel, FullyShardedDataParallel,
/// ZeroRedundancyOptimizer, DistributedOptimizer, DecentralizedDataParallel) or the local
/// optimizer of a DDP model, listed after the wrapper so the idle rank steps it on the shadowed
/// step's averaged gradients.
class Joined {
 public:
  template <class T>
  Joined(T& participant) {  // NOLINT(google-explicit-constructor): join({ddp, optimizer}, ...)
    static_assert(std::is_base_of_v<Joinable, T> || std::is_base_of_v<optim::Optimizer, T>,
                  "join() takes data-parallel wrappers (parallel::Joinable) and optimizers");
    if constexpr (std::is_base_of_v<Joinable, T>)
      joinable_ = &participant;
    else
      optimizer_ = &participant;
  }

 private:
  friend void join(const std::vector<Joined>& joined, const std::function<void()>& loop);
  Joinable* joinable_ = nullptr;
  optim::Optimizer* optimizer_ = nullptr;
};

/// Runs `loop` (this rank's training loop) with uneven inputs allowed across the group of the
/// listed wrappers (all must share one group), then shadows the other ranks' remaining steps
/// until every rank's loop has returned. Collective: every rank of the group calls it. Nested
/// join() regions are an error.
void join(const std::vector<Joined>& joined, const std::function<void()>& loop);

}  // namespace weave::parallel

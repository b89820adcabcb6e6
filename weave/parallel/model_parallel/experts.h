#pragma once
// Expert parallelism: an MoE layer whose experts are spread over the ranks of an expert group
// (GShard, Megatron-core). Each rank routes its own tokens, sends each kept assignment to the
// rank that holds its expert (an all_to_all with uneven splits), runs its own experts on what
// arrives, and sends the results back (the same exchange backwards) to be weighted by the gates.
//
//   parallel::ExpertParallelMoE moe({.hidden = 64, .ffn = 256,
//                                    .router = {.experts = 8, .top_k = 2}}, mesh.expert());
//   Tensor y = moe(x);                                  // this rank's tokens
//   Tensor loss = cross_entropy(head(y), targets) + moe.aux_loss();
//
// Rank r of n holds experts [r E / n, (r + 1) E / n), built from the same seed as nn::MoE's, so
// for the same tokens the layer equals nn::MoE in values, gradients and the auxiliary loss.
// The router is replicated: keep it equal across the group (as data parallelism does).
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "weave/distributed/distributed.h"
#include "weave/nn/moe.h"

namespace weave::parallel {

struct ExpertParallelStats {
  int64_t tokens = 0, assignments = 0;
  /// Assignments beyond an expert's capacity, on this rank's tokens.
  int64_t dropped = 0;
  /// Rows this rank sent to other ranks' experts, and received for its own, in the forward's
  /// dispatch (the combine moves as many back); bytes counts forward's dispatch and combine,
  /// sent and received.
  int64_t rows_sent = 0, rows_received = 0;
  int64_t bytes_exchanged = 0;
};

/// The ShareReduction of a data-parallel group: the mean of the ranks' shares (collective; for
/// nn::MoE::reduce_shares under data parallelism).
nn::ShareReduction shares_over(const dist::Group& group);

class ExpertParallelMoE : public nn::Module {
 public:
  /// Collective over the group: every rank passes the same options; the experts must divide
  /// over the group (or every rank raises). With `balance_group` (the data-parallel ranks whose
  /// batches one step trains on, the expert group among them) the load-balancing loss counts
  /// their assignments together, so the layer equals one process on their stacked batches.
  ExpertParallelMoE(nn::MoEOptions options, dist::Group group,
                    std::optional<dist::Group> balance_group = std::nullopt);
  /// x [..., hidden] -> [..., hidden]: this rank's tokens. Collective over the group.
  Tensor forward(const Tensor& x) override;
  const Tensor& aux_loss() const { return aux_loss_; }
  const ExpertParallelStats& stats() const { return stats_; }
  nn::TopKRouter& router() { return *router_; }
  /// The experts this rank holds: global indices [first_expert(), first_expert() + local).
  int64_t first_expert() const { return first_; }
  int64_t local_experts() const { return int64_t(experts_.size()); }
  nn::Module& expert(int64_t local) { return *experts_[size_t(local)]; }
  const dist::Group& group() const { return group_; }

 private:
  // What arrives for this rank's experts, run expert by expert, back in arrival order.
  Tensor run_experts(const Tensor& received, const std::vector<int64_t>& counts);

  nn::MoEOptions options_;
  dist::Group group_;
  nn::ShareReduction reduce_shares_;  // over the balance group, if one was given
  int64_t first_ = 0;
  std::shared_ptr<nn::TopKRouter> router_;
  std::vector<std::shared_ptr<nn::Module>> experts_;
  Tensor aux_loss_;
  ExpertParallelStats stats_;
};

}  // namespace weave::parallel

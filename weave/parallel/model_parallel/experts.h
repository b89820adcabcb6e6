#pragma once
// Expert parallelism: nn::MoE with its experts spread over the ranks of an expert group
// (GShard, Megatron-core). Each rank routes its own tokens, sends each kept assignment to the
// rank that holds its expert (an all_to_all with uneven splits), runs its own experts on what
// arrives, and sends the results back (the same exchange backwards) to be weighted by the gates.
//
//   nn::MoEOptions options{.hidden = 64, .ffn = 256, .router = {.experts = 8, .top_k = 2}};
//   options.reduce_shares = parallel::shares_over(mesh.data());   // balance over the step's batch
//   parallel::ExpertParallelMoE moe(options, mesh.expert());
//   Tensor y = moe(x);                                  // this rank's tokens
//   Tensor loss = cross_entropy(head(y), targets) + moe.aux_loss();
//
// Rank r of n holds experts [r E / n, (r + 1) E / n), built from the same seed as a local
// nn::MoE's, so for the same tokens the layer equals the local one in values, gradients and the
// auxiliary loss. The router is replicated: keep it equal across the group (as data
// parallelism does).
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "weave/distributed/distributed.h"
#include "weave/nn/leaves.h"
#include "weave/nn/moe.h"

namespace weave::parallel {

/// The mean of the ranks' load-balancing shares over `group` (collective): for
/// nn::MoEOptions::reduce_shares under data parallelism.
nn::ShareReduction shares_over(const dist::Group& group);

/// The token dispatcher of an expert group: rows to the rank holding their expert by an uneven
/// all_to_all, and back the same way. Collective over the group at every forward.
class ExpertParallelDispatcher : public nn::TokenDispatcher {
 public:
  explicit ExpertParallelDispatcher(dist::Group group) : group_(std::move(group)) {}
  std::pair<int64_t, int64_t> held_experts(int64_t experts) const override;
  void check_forward() const override;
  Tensor dispatch(const Tensor& rows, const std::vector<int64_t>& per_expert,
                  const nn::ExpertRun& run, nn::MoEStats& stats) override;
  const dist::Group& group() const { return group_; }

 private:
  dist::Group group_;
};

/// nn::MoE over an expert group. Collective over the group: every rank passes the same options;
/// the experts must divide over the group (or every rank raises).
class ExpertParallelMoE : public nn::MoE {
 public:
  ExpertParallelMoE(nn::MoEOptions options, dist::Group group);
  const dist::Group& group() const { return group_; }

 private:
  dist::Group group_;
};

/// The experts a transformer block puts in place of its MLP (nn/leaves.h): spread over
/// expert_group when it has several ranks (ExpertParallelMoE), else nn::MoE; the load-balancing
/// loss counts balance_group's batches when that has several ranks (the step's batch: data x
/// context).
class SpreadExperts : public nn::ExpertLeaves {
 public:
  SpreadExperts(std::optional<dist::Group> expert_group, std::optional<dist::Group> balance_group)
      : expert_group_(std::move(expert_group)), balance_group_(std::move(balance_group)) {}
  std::shared_ptr<nn::MoE> make(const nn::MoEOptions& options) const override;

 private:
  std::optional<dist::Group> expert_group_, balance_group_;
};
/// SpreadExperts (shared, for nn::Leaves::experts).
std::shared_ptr<const nn::ExpertLeaves> spread_experts(std::optional<dist::Group> expert_group,
                                                       std::optional<dist::Group> balance_group);

}  // namespace weave::parallel

// Expert parallelism: the agreement on the layer, and the dispatcher's uneven all_to_alls.
#include "weave/parallel/model_parallel/experts.h"

#include "weave/distributed/functional.h"
#include "weave/ops/ops.h"
#include "weave/parallel/core/agree.h"
#include "weave/parallel/core/joinable.h"
#include "weave/parallel/core/placement.h"

namespace weave::parallel {

namespace {

namespace F = dist::functional;
constexpr const char* kExpertsOp = "ExpertParallelMoE";

// Every rank of the group checks the options and agrees on them before any expert is built.
nn::MoEOptions agreed(nn::MoEOptions options, const dist::Group& group) {
  WEAVE_CHECK(group.rank() >= 0, kExpertsOp, "rank {} is not in group {}", dist::rank(),
              group.str());
  const int64_t experts = options.router.experts;
  const detail::ValueRange range = detail::check_together(
      [&] {
        nn::check_moe_options(options);
        // The ranks route different tokens: a selection bias counted on each rank's own would
        // drift apart, and the replicated router with it.
        WEAVE_CHECK(
            options.router.bias_update_rate == 0 || group.size() == 1 || options.reduce_shares,
            kExpertsOp,
            "a selection bias (bias_update_rate {}) over expert group {} needs the loads "
            "of every rank that balances; hint: set reduce_shares = "
            "parallel::shares_over(the data x context group, which holds the expert "
            "group)",
            options.router.bias_update_rate, group.str());
        WEAVE_CHECK(experts % group.size() == 0, kExpertsOp,
                    "{} experts do not divide over the {} ranks of expert group {}; hint: use a "
                    "multiple of the group size",
                    experts, group.size(), group.str());
      },
      group, kExpertsOp,
      {options.hidden, options.ffn, experts, options.router.top_k, int64_t(options.seed),
       options.gated ? 1 : 0, options.shared_ffn, options.shared_gate ? 1 : 0});
  for (size_t i = 0; i < range.lowest.size(); ++i)
    WEAVE_CHECK(range.same(i), kExpertsOp,
                "the ranks of group {} pass different options (hidden, ffn, experts, top_k, "
                "seed, gated, shared_ffn, shared_gate: entry {} from {} to {})",
                group.str(), i, range.lowest[i], range.highest[i]);
  // The router's float options too: a rank with another capacity or coefficient would drop
  // other tokens or train toward another loss, silently.
  const nn::RouterOptions& r = options.router;
  detail::check_same_lines(
      {fmt::format("gate {}", int(r.gate)), fmt::format("renormalize {}", r.renormalize),
       fmt::format("capacity_factor {:.17g}", r.capacity_factor),
       fmt::format("aux_loss_coef {:.17g}", r.aux_loss_coef),
       fmt::format("z_loss_coef {:.17g}", r.z_loss_coef),
       fmt::format("bias_update_rate {:.17g}", r.bias_update_rate)},
      group, kExpertsOp, "the router's options",
      "build the layer from the same MoEOptions on every rank");
  return options;
}

}  // namespace

nn::ShareReduction shares_over(const dist::Group& group) {
  return [group](const std::vector<double>& mine) {
    Tensor shares = from_vector(mine);
    dist::all_reduce(shares, dist::ReduceOp::Avg, group);
    return shares.to_vector<double>();
  };
}

std::pair<int64_t, int64_t> ExpertParallelDispatcher::held_experts(int64_t experts) const {
  const int64_t local = experts / group_.size();
  return {group_.rank() * local, local};
}

void ExpertParallelDispatcher::check_forward() const {
  // Every rank reaches its first forward in the region (none has run out yet), so all raise.
  WEAVE_CHECK(group_.size() == 1 || !detail::in_join_region(), kExpertsOp,
              "it cannot run inside parallel::join(): a rank out of inputs cannot shadow its "
              "token exchange (all_to_all) over group {}, whose ranks train on different "
              "batches; hint: give every rank the same number of batches (DistributedSampler "
              "pads or drops to equal shares) and train without join()",
              group_.str());
}

Tensor ExpertParallelDispatcher::dispatch(const Tensor& rows,
                                          const std::vector<int64_t>& per_expert,
                                          const nn::ExpertRun& run, nn::MoEStats& stats) {
  const int n = group_.size(), me = group_.rank();
  const int64_t experts = int64_t(per_expert.size()), local = experts / n;
  // Each rank learns how many rows of each of its experts every rank sends: the exchanges need
  // no plan of their own.
  Tensor counts = empty({experts}, {.dtype = kInt64});
  dist::all_to_all(counts, from_vector(per_expert), group_);
  const std::vector<int64_t> from_each = counts.to_vector<int64_t>();
  std::vector<int64_t> send(size_t(n), 0), receive(size_t(n), 0), held(size_t(local), 0);
  for (int64_t e = 0; e < experts; ++e) {
    send[size_t(e / local)] += per_expert[size_t(e)];
    receive[size_t(e / local)] += from_each[size_t(e)];
    held[size_t(e % local)] += from_each[size_t(e)];
  }
  const Tensor received = F::all_to_all(rows, send, receive, group_);
  // Arrival order: by source rank, then by held expert (each source sent its rows sorted). The
  // experts run once on the rows sorted by held expert (none: a zero gradient, as the local
  // layer's), and the outputs go back in arrival order.
  Tensor processed;
  if (n == 1 || local == 1) {  // arrival order is already by expert
    processed = run(received, held);
  } else {
    std::vector<int64_t> first_of(size_t(n * local)), sorted;
    for (int64_t at = 0, s = 0; s < n; ++s)
      for (int64_t le = 0; le < local; ++le) {
        first_of[size_t(s * local + le)] = at;
        at += from_each[size_t(s * local + le)];
      }
    std::vector<int64_t> position(size_t(received.size(0)));
    for (int64_t le = 0; le < local; ++le)
      for (int64_t s = 0; s < n; ++s)
        for (int64_t i = 0; i < from_each[size_t(s * local + le)]; ++i) {
          position[size_t(first_of[size_t(s * local + le)] + i)] = int64_t(sorted.size());
          sorted.push_back(first_of[size_t(s * local + le)] + i);
        }
    const auto pick = [&](const Tensor& t, const std::vector<int64_t>& index) {
      return index_select(t, 0, from_vector(index).to(t.device()));
    };
    processed = pick(run(pick(received, sorted), held), position);
  }
  for (int j = 0; j < n; ++j) {
    if (j == me) continue;
    stats.rows_sent += send[size_t(j)];
    stats.rows_received += receive[size_t(j)];
  }
  stats.bytes_exchanged =
      2 * (stats.rows_sent + stats.rows_received) * rows.size(1) * int64_t(rows.itemsize());
  return F::all_to_all(processed, receive, send, group_);
}

ExpertParallelMoE::ExpertParallelMoE(nn::MoEOptions options, dist::Group group)
    : nn::MoE(agreed(std::move(options), group), std::make_shared<ExpertParallelDispatcher>(group)),
      group_(std::move(group)) {
  // Each rank's experts are its own: their norms add up over the group, and nothing that
  // treats parameters as replicas (a local clip, a replica check) may take them for ones.
  for (int64_t e = first_expert(); e < first_expert() + local_experts(); ++e)
    for (const Tensor& p : expert(e).parameters())
      add_cut(p, {.kind = Cut::Kind::Experts,
                  .group = group_,
                  .first = first_expert(),
                  .count = local_experts(),
                  .total = local_experts() * group_.size()});
}

std::shared_ptr<nn::MoE> SpreadExperts::make(const nn::MoEOptions& moe) const {
  nn::MoEOptions options = moe;
  if (balance_group_ && balance_group_->size() > 1)
    options.reduce_shares = shares_over(*balance_group_);
  if (expert_group_ && expert_group_->size() > 1)
    return std::make_shared<ExpertParallelMoE>(options, *expert_group_);
  return std::make_shared<nn::MoE>(options);
}

std::shared_ptr<const nn::ExpertLeaves> spread_experts(std::optional<dist::Group> expert_group,
                                                       std::optional<dist::Group> balance_group) {
  return std::make_shared<SpreadExperts>(std::move(expert_group), std::move(balance_group));
}

}  // namespace weave::parallel

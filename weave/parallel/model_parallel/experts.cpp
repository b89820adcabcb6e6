// Expert parallelism: dispatch by an uneven all_to_all, the local experts, and the combine.
#include "weave/parallel/model_parallel/experts.h"

#include "weave/distributed/functional.h"
#include "weave/ops/ops.h"
#include "weave/parallel/core/agree.h"
#include "weave/parallel/core/joinable.h"
#include "weave/parallel/core/placement.h"

namespace weave::parallel {

namespace {

namespace F = dist::functional;
constexpr const char* kOp = "ExpertParallelMoE";

}  // namespace

nn::ShareReduction shares_over(const dist::Group& group) {
  return [group](const std::vector<double>& mine) {
    Tensor shares = from_vector(mine);
    dist::all_reduce(shares, dist::ReduceOp::Avg, group);
    return shares.to_vector<double>();
  };
}

ExpertParallelMoE::ExpertParallelMoE(nn::MoEOptions options, dist::Group group,
                                     std::optional<dist::Group> balance_group)
    : nn::Module("ExpertParallelMoE"),
      options_(options),
      group_(std::move(group)),
      reduce_shares_(balance_group ? shares_over(*balance_group) : nullptr) {
  WEAVE_CHECK(group_.rank() >= 0, kOp, "rank {} is not in group {}", dist::rank(), group_.str());
  const int n = group_.size();
  const int64_t experts = options.router.experts;
  Generator g(options.seed);
  const detail::ValueRange agreed = detail::check_together(
      [&] {
        router_ = register_module(
            "router", std::make_shared<nn::TopKRouter>(options.hidden, options.router, &g));
        WEAVE_CHECK(experts % n == 0, kOp,
                    "{} experts do not divide over the {} ranks of expert group {}; hint: use a "
                    "multiple of the group size",
                    experts, n, group_.str());
      },
      group_, kOp,
      {options.hidden, options.ffn, experts, options.router.top_k, int64_t(options.seed)});
  for (size_t i = 0; i < agreed.lowest.size(); ++i)
    WEAVE_CHECK(agreed.same(i), kOp,
                "the ranks of group {} pass different options (hidden, ffn, experts, top_k, "
                "seed: entry {} from {} to {})",
                group_.str(), i, agreed.lowest[i], agreed.highest[i]);
  // The router's float options too: a rank with another capacity or coefficient would drop
  // other tokens or train toward another loss, silently.
  const nn::RouterOptions& r = options.router;
  detail::check_same_lines(
      {fmt::format("gate {}", int(r.gate)), fmt::format("renormalize {}", r.renormalize),
       fmt::format("capacity_factor {:.17g}", r.capacity_factor),
       fmt::format("aux_loss_coef {:.17g}", r.aux_loss_coef),
       fmt::format("z_loss_coef {:.17g}", r.z_loss_coef)},
      group_, kOp, "the router's options",
      "build the layer from the same MoEOptions on every rank");
  const int64_t local = experts / n;
  first_ = group_.rank() * local;
  for (int64_t e = first_; e < first_ + local; ++e)
    experts_.push_back(register_module(
        fmt::format("expert{}", e), nn::make_expert(options.hidden, options.ffn, options.seed, e)));
  // Each rank's experts are its own: their norms add up over the group, and nothing that
  // treats parameters as replicas (a local clip, a replica check) may take them for ones.
  for (const auto& expert : experts_)
    for (const Tensor& p : expert->parameters())
      add_cut(p, {.kind = Cut::Kind::Experts,
                  .group = group_,
                  .first = first_,
                  .count = local,
                  .total = experts});
}

Tensor ExpertParallelMoE::forward(const Tensor& x) {
  const int n = group_.size(), me = group_.rank();
  // Every rank reaches its first forward in the region (none has run out yet), so all raise.
  WEAVE_CHECK(n == 1 || !detail::in_join_region(), "ExpertParallelMoE",
              "it cannot run inside parallel::join(): a rank out of inputs cannot shadow its "
              "token exchange (all_to_all) over group {}, whose ranks train on different "
              "batches; hint: give every rank the same number of batches (DistributedSampler "
              "pads or drops to equal shares) and train without join()",
              group_.str());
  const int64_t experts = options_.router.experts, local = experts / n, hidden = options_.hidden;
  const Shape shape = x.shape();
  const Tensor tokens = x.reshape({-1, hidden});
  const nn::Routing routing = router_->route(tokens, is_training() ? reduce_shares_ : nullptr);
  aux_loss_ = routing.aux_loss;
  const nn::detail::Dispatch dispatch = nn::detail::plan_dispatch(routing, experts);
  // Each rank learns how many rows of each of its experts every rank sends.
  Tensor counts = empty({experts}, {.dtype = kInt64});
  dist::all_to_all(counts, from_vector(dispatch.per_expert), group_);
  std::vector<int64_t> send(size_t(n), 0);
  for (int64_t e = 0; e < experts; ++e) send[size_t(e / local)] += dispatch.per_expert[size_t(e)];
  // The counts say what every rank sends: the exchanges need no plan of their own.
  const std::vector<int64_t> from_each = counts.to_vector<int64_t>();
  std::vector<int64_t> receive(size_t(n), 0);
  for (int64_t i = 0; i < experts; ++i) receive[size_t(i / local)] += from_each[size_t(i)];
  const Tensor received =
      F::all_to_all(nn::detail::dispatch_rows(tokens, dispatch), send, receive, group_);
  const Tensor processed = run_experts(received, from_each);
  const Tensor returned = F::all_to_all(processed, receive, send, group_);
  stats_ = {.tokens = tokens.size(0),
            .assignments = tokens.size(0) * options_.router.top_k,
            .dropped = routing.dropped,
            .rows_sent = 0,
            .rows_received = 0,
            .bytes_exchanged = 0};
  for (int j = 0; j < n; ++j) {
    if (j == me) continue;
    stats_.rows_sent += send[size_t(j)];
    stats_.rows_received += receive[size_t(j)];
  }
  stats_.bytes_exchanged =
      2 * (stats_.rows_sent + stats_.rows_received) * hidden * int64_t(x.itemsize());
  return nn::detail::combine(returned, dispatch, routing.weight).reshape(shape);
}

Tensor ExpertParallelMoE::run_experts(const Tensor& received, const std::vector<int64_t>& counts) {
  const int n = group_.size();
  const int64_t local = local_experts();
  // Arrival order: by source rank, then by local expert. Expert order: by expert, then source.
  std::vector<std::vector<int64_t>> rows_of(static_cast<size_t>(local));
  int64_t at = 0;
  for (int s = 0; s < n; ++s)
    for (int64_t le = 0; le < local; ++le)
      for (int64_t i = 0; i < counts[size_t(s * local + le)]; ++i)
        rows_of[size_t(le)].push_back(at++);
  std::vector<Tensor> outputs;
  std::vector<int64_t> arrival_to_expert_order(static_cast<size_t>(at));
  int64_t position = 0;
  for (int64_t le = 0; le < local; ++le) {
    const std::vector<int64_t>& rows = rows_of[size_t(le)];  // none: a zero gradient (nn::MoE)
    for (int64_t r : rows) arrival_to_expert_order[size_t(r)] = position++;
    const Tensor index = from_vector(rows).to(received.device());
    outputs.push_back((*experts_[size_t(le)])(index_select(received, 0, index)));
  }
  return index_select(cat(outputs), 0, from_vector(arrival_to_expert_order).to(received.device()));
}

}  // namespace weave::parallel

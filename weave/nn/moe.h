#pragma once
// Mixture of experts: a router picks top_k of `experts` feed-forward networks for each token, and
// the token's output is their outputs weighted by the router's gates (Switch Transformer,
// GShard, Mixtral). Only the chosen experts run, so the parameters grow with the experts while
// the compute per token does not.
//
//   nn::MoE moe({.hidden = 64, .ffn = 256, .router = {.experts = 8, .top_k = 2}});
//   Tensor y = moe(x);                              // x [..., 64] -> [..., 64]
//   Tensor loss = cross_entropy(head(y), targets) + moe.aux_loss();
//
// Experts are built from `seed` and their index alone, so every layout of the same experts
// (this dense layer, or parallel::ExpertParallelMoE spread over ranks) starts equal.
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "weave/nn/module.h"

namespace weave::nn {

enum class Gate { Softmax, Sigmoid };

struct RouterOptions {
  int64_t experts = 8;
  int64_t top_k = 2;
  /// Softmax: gates from the softmax over all experts. Sigmoid (DeepSeek-V3): independent gates,
  /// the chosen ones normalized to sum to 1.
  Gate gate = Gate::Softmax;
  /// Softmax gates: the chosen top_k renormalized to sum to 1 (Mixtral); false keeps the raw
  /// probabilities (Switch).
  bool renormalize = true;
  /// Each expert takes at most ceil(capacity_factor * tokens * top_k / experts) of a batch's
  /// assignments (first choices first, then second choices, each in token order); the rest are
  /// dropped: their gate is zero and the token keeps only what its other experts give. 0: no
  /// limit.
  double capacity_factor = 0;
  /// The load-balancing loss (Switch: experts * sum_e f_e P_e, with f_e the share of
  /// assignments expert e gets and P_e its mean probability), times this.
  double aux_loss_coef = 0.01;
  /// The router z-loss (ST-MoE: the mean squared log-sum-exp of the logits), times this.
  double z_loss_coef = 0;
};

/// One batch's routing: for token t, its j-th choice is expert[t, j] with gate weight[t, j].
struct Routing {
  Tensor expert;    // int64 [tokens, top_k]
  Tensor weight;    // [tokens, top_k], differentiable; 0 where dropped
  Tensor kept;      // bool [tokens, top_k]: within the expert's capacity
  Tensor aux_loss;  // scalar, the coefficients applied; differentiable
  int64_t dropped = 0;
  int64_t capacity = 0;  // per expert; 0 without a limit
};

/// Turns this batch's share of assignments per expert into the shares over every batch the loss
/// averages over (data-parallel ranks: an all_reduce of the shares, divided by their count), so
/// that the load-balancing loss equals one process's on the stacked batches (Megatron's global
/// load balancing). Null: this batch's own.
using ShareReduction = std::function<std::vector<double>(const std::vector<double>&)>;

class TopKRouter : public Module {
 public:
  /// Checks the options (top_k from 1 to experts, capacity_factor 0 or positive).
  TopKRouter(int64_t hidden, RouterOptions options, Generator* generator = nullptr);
  /// tokens [T, hidden].
  Routing route(const Tensor& tokens, const ShareReduction& shares = nullptr) const;
  /// The logits [T, experts].
  Tensor forward(const Tensor& tokens) override;
  const RouterOptions& options() const { return options_; }
  Tensor& weight;  // [experts, hidden]

 private:
  RouterOptions options_;
};

struct MoEOptions {
  int64_t hidden = 0;
  int64_t ffn = 0;
  RouterOptions router{};
  uint64_t seed = 0;
};

/// Expert `index` of a layer built from `seed`: hidden -> ffn -> GELU -> hidden.
std::shared_ptr<Module> make_expert(int64_t hidden, int64_t ffn, uint64_t seed, int64_t index);

struct MoEStats {
  int64_t tokens = 0;       // of the last forward
  int64_t assignments = 0;  // tokens * top_k
  int64_t dropped = 0;      // assignments beyond an expert's capacity
};

/// Every expert on this rank.
class MoE : public Module {
 public:
  explicit MoE(MoEOptions options);
  /// x [..., hidden] -> [..., hidden].
  Tensor forward(const Tensor& x) override;
  /// The last forward's auxiliary loss (add it to the training loss).
  const Tensor& aux_loss() const { return aux_loss_; }
  const MoEStats& stats() const { return stats_; }
  TopKRouter& router() { return *router_; }
  Module& expert(int64_t index) { return *experts_[size_t(index)]; }
  /// Applied to the load-balancing shares of every forward in training mode (see
  /// ShareReduction); evaluation uses its own batch's.
  ShareReduction reduce_shares = nullptr;

 private:
  MoEOptions options_;
  std::shared_ptr<TopKRouter> router_;
  std::vector<std::shared_ptr<Module>> experts_;
  Tensor aux_loss_;
  MoEStats stats_;
};

namespace detail {

/// The rows an MoE layer sends to its experts: every kept assignment, expert by expert (within
/// an expert in token order), so each expert's rows are contiguous.
struct Dispatch {
  std::vector<int64_t> token;        // the token of each dispatched row
  std::vector<int64_t> per_expert;   // rows of each expert
  std::vector<int64_t> row_of_slot;  // slot t * top_k + j -> its dispatched row, or -1 (dropped)
};
Dispatch plan_dispatch(const Routing& routing, int64_t experts);
/// The tokens' rows in dispatch order (differentiable).
Tensor dispatch_rows(const Tensor& tokens, const Dispatch& dispatch);
/// output[t] = sum_j weight[t, j] rows[row_of_slot[t * top_k + j]] (differentiable in rows and
/// weight); rows holds the experts' outputs in dispatch order, and weight is 0 at dropped slots
/// (as Routing::weight is).
Tensor combine(const Tensor& rows, const Dispatch& dispatch, const Tensor& weight);

}  // namespace detail

}  // namespace weave::nn

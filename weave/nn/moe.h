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
// One layer for every layout of the experts, as Megatron's: a token dispatcher moves the routed
// rows to the experts and back. The local one (the default) runs every expert on this rank;
// parallel::ExpertParallelMoE is this layer with the expert-parallel dispatcher (each rank holds
// a range of the experts, and rows travel by all_to_all). Experts are built from `seed` and
// their index alone, so every layout of the same experts starts equal.
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
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

/// The load-balancing shares over every batch the loss averages over (MoEOptions::reduce_shares).
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
  /// Each expert a SwiGLU MLP without biases, down(silu(gate x) * up x) (Mixtral's and Qwen's
  /// experts: nn::GatedMLP, its gate and up one parameter gate_up); else hidden -> ffn -> GELU
  /// -> hidden with biases.
  bool gated = false;
  /// A shared expert every token passes through, a SwiGLU MLP of this width added to the routed
  /// experts' output (0: none); with shared_gate its output is scaled by sigmoid(x w) first, w
  /// [1, hidden] (Qwen 2 MoE's shared_expert and shared_expert_gate).
  int64_t shared_ffn = 0;
  bool shared_gate = false;
  /// Turns each training forward's shares of assignments per expert into the shares over every
  /// batch the loss averages over (the data-parallel ranks: parallel::shares_over(group)), so
  /// that the load-balancing loss equals one process's on the stacked batches (Megatron's
  /// global load balancing). Null: the batch's own. Evaluation always uses its own batch's (it
  /// may run on some ranks alone).
  ShareReduction reduce_shares = nullptr;
};

/// Raises unless the options make a layer (hidden, ffn and the router's options).
void check_moe_options(const MoEOptions& options);

/// Expert `index` of a layer built from `seed`: hidden -> ffn -> GELU -> hidden, or with gated a
/// SwiGLU nn::GatedMLP of width ffn.
std::shared_ptr<Module> make_expert(int64_t hidden, int64_t ffn, uint64_t seed, int64_t index,
                                    bool gated = false);

struct MoEStats {
  int64_t tokens = 0;       // of the last forward
  int64_t assignments = 0;  // tokens * top_k
  int64_t dropped = 0;      // assignments beyond an expert's capacity
  /// Rows this rank sent to other ranks' experts, and received for its own, in the forward's
  /// dispatch (the combine moves as many back); bytes counts the dispatch and the combine, sent
  /// and received. Zero under the local dispatcher.
  int64_t rows_sent = 0, rows_received = 0;
  int64_t bytes_exchanged = 0;
};

/// Moves an MoE layer's routed rows to its experts and their outputs back (Megatron's token
/// dispatcher). A dispatcher serves one layer.
class TokenDispatcher {
 public:
  virtual ~TokenDispatcher() = default;
  /// The first of the experts this rank holds, and how many, of a layer of `experts`.
  virtual std::pair<int64_t, int64_t> held_experts(int64_t experts) const = 0;
  /// Runs before routing: raises where this forward cannot be served.
  virtual void check_forward() const {}
  /// `rows` [R, hidden] in dispatch order (per_expert[e] rows for each expert e of the layer,
  /// expert by expert) -> the experts' outputs, in the same order. `run(e, rows)` runs held
  /// expert e. Fills the stats of the exchange.
  virtual Tensor dispatch(const Tensor& rows, const std::vector<int64_t>& per_expert,
                          const std::function<Tensor(int64_t, const Tensor&)>& run,
                          MoEStats& stats) = 0;
};

/// Every expert on this rank: each runs on its rows where they lie.
class LocalDispatcher : public TokenDispatcher {
 public:
  std::pair<int64_t, int64_t> held_experts(int64_t experts) const override { return {0, experts}; }
  Tensor dispatch(const Tensor& rows, const std::vector<int64_t>& per_expert,
                  const std::function<Tensor(int64_t, const Tensor&)>& run,
                  MoEStats& stats) override;
};

class MoE : public Module {
 public:
  /// The experts the dispatcher says this rank holds (LocalDispatcher when null: all of them).
  explicit MoE(MoEOptions options, std::shared_ptr<TokenDispatcher> dispatcher = nullptr);
  /// x [..., hidden] -> [..., hidden].
  Tensor forward(const Tensor& x) override;
  /// The last forward's auxiliary loss (add it to the training loss, or attach it: below).
  const Tensor& aux_loss() const { return aux_loss_; }
  /// `y` (this layer's last output) carrying the last forward's auxiliary loss into backward
  /// while training (attach_loss), so that no trainer adds it: the transformer blocks' rule, the
  /// same on every pipeline stage. `y` itself outside training or without a differentiable loss.
  /// A loop that accumulates gradients by hand over k micro-batches (each loss / k) opens a
  /// SideLossScope(1.0 / k) around each forward, as parallel::Pipeline does.
  Tensor with_aux_loss(const Tensor& y) const;
  const MoEStats& stats() const { return stats_; }
  TopKRouter& router() { return *router_; }
  /// The experts this rank holds: global indices [first_expert(), first_expert() +
  /// local_experts()).
  int64_t first_expert() const { return first_; }
  int64_t local_experts() const { return int64_t(experts_.size()); }
  /// Expert `index` (a global index, of an expert this rank holds).
  Module& expert(int64_t index);
  /// The shared expert and its gate (null without).
  std::shared_ptr<Module> shared, shared_gate;

 private:
  MoEOptions options_;
  std::shared_ptr<TokenDispatcher> dispatcher_;
  int64_t first_ = 0;
  std::shared_ptr<TopKRouter> router_;
  std::vector<std::shared_ptr<Module>> experts_;
  Tensor aux_loss_;
  MoEStats stats_;
};

}  // namespace weave::nn

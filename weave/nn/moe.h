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
// The routed rows are sorted by expert once (a stable sort of the routing), each projection of
// every expert runs as one grouped GEMM over them (grouped_linear: one autograd node, not one
// per expert), and the outputs return weighted by the gates: the layer costs about what a
// dense MLP of width top_k * ffn costs on the same tokens, plus the routing. Dropless unless a
// capacity_factor is set.
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
  /// Balancing without an auxiliary loss (DeepSeek-V3): a bias per expert ("expert_bias", a
  /// buffer saved with the model) is added to the gate scores to choose each token's top_k
  /// only (the gates keep the unbiased scores), and after each step nn::update_expert_biases
  /// moves it by this rate toward balance: + rate for an expert that took fewer than the mean
  /// of the step's assignments over every balancing rank (MoEOptions::reduce_shares), - rate
  /// for one that took more. 0: no bias. Set aux_loss_coef to 0 to balance by the bias alone.
  double bias_update_rate = 0;
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
  /// The selection bias [experts] (float32 zeros at first; undefined unless bias_update_rate).
  Tensor expert_bias() const { return bias_ ? *bias_ : Tensor(); }
  /// Moves the selection bias toward balance by the options' rate, given the assignments each
  /// expert took over the step (every balancing rank's: a mean or a sum, the same on each).
  void update_bias(const std::vector<double>& load);
  /// tokens [T, hidden].
  Routing route(const Tensor& tokens, const ShareReduction& shares = nullptr) const;
  /// The logits [T, experts].
  Tensor forward(const Tensor& tokens) override;
  const RouterOptions& options() const { return options_; }
  Tensor& weight;  // [experts, hidden]

 private:
  RouterOptions options_;
  Tensor* bias_ = nullptr;
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
  /// The experts' projections as grouped GEMMs over the rows sorted by expert (one autograd
  /// node per projection); false runs each expert as its own module, one after another (the
  /// reference the grouped path is tested and benchmarked against). An expert with forward hooks
  /// of its own, or with adapters, always runs as its own module.
  bool grouped = true;
  /// Turns each training forward's shares of assignments per expert (and the step's loads for the
  /// selection bias) into the mean over every batch the loss averages over (the data-parallel
  /// ranks: parallel::shares_over(group)), so that the load-balancing loss equals one process's on
  /// the stacked batches (Megatron's global load balancing). Null: the batch's own. Evaluation
  /// always uses its own batch's (it may run on some ranks alone).
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
  /// Assignments each expert of the layer was chosen for (before capacity drops), this rank's.
  std::vector<int64_t> load;
  /// Rows this rank sent to other ranks' experts, and received for its own, in the forward's
  /// dispatch (the combine moves as many back); bytes counts the dispatch and the combine, sent
  /// and received. Zero under the local dispatcher.
  int64_t rows_sent = 0, rows_received = 0;
  int64_t bytes_exchanged = 0;
};

/// Runs the experts a rank holds on `rows` sorted by held expert: counts[i] rows for the i-th
/// held expert, in order (every held expert, a count of 0 for one that got none); returns their
/// outputs in the same order.
using ExpertRun = std::function<Tensor(const Tensor& rows, const std::vector<int64_t>& counts)>;

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
  /// expert by expert) -> the experts' outputs, in the same order. `run` runs the held experts
  /// once, on their rows sorted by expert. Fills the stats of the exchange.
  virtual Tensor dispatch(const Tensor& rows, const std::vector<int64_t>& per_expert,
                          const ExpertRun& run, MoEStats& stats) = 0;
};

/// Every expert on this rank: each runs on its rows where they lie.
class LocalDispatcher : public TokenDispatcher {
 public:
  std::pair<int64_t, int64_t> held_experts(int64_t experts) const override { return {0, experts}; }
  Tensor dispatch(const Tensor& rows, const std::vector<int64_t>& per_expert, const ExpertRun& run,
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
  /// Moves the router's selection bias toward balance by the loads of the training forwards
  /// since the last call (reduced by the options' reduce_shares: collective over its ranks),
  /// then starts counting anew. Nothing without bias_update_rate.
  void update_expert_bias();
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
  std::vector<int64_t> step_load_;  // training assignments per expert since the last update

  Tensor run_experts(const Tensor& rows, const std::vector<int64_t>& counts);
  Tensor run_each(const Tensor& rows, const std::vector<int64_t>& counts);
};

/// Every MoE layer of `model` (in named_modules' order) moves its selection bias
/// (MoE::update_expert_bias): call it after each optimizer step, on every rank. Collective over
/// each layer's balancing ranks.
void update_expert_biases(Module& model);

/// Each MoE layer's routing in the last forward, for a metrics logger: "<layer>/max_load" (the
/// busiest expert's assignments over the mean, 1 when balanced) and "<layer>/dropped" (the
/// share of assignments dropped by capacity), this rank's.
std::vector<std::pair<std::string, double>> routing_metrics(const Module& model);

}  // namespace weave::nn

#pragma once
// Optimizers. Each keeps its per-parameter state next to the parameter it belongs to and
// updates parameters in place (without recording autograd).
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "weave/nn/module.h"
#include "weave/ops/ops.h"

namespace weave::optim {

/// An optimizer's state, for checkpoints: its state tensors by name ("exp_avg.3" is parameter
/// 3's first moment; a parameter whose state does not exist yet has no entry) and its numbers
/// ("lr", "params" (the parameter count), "step" for Adam).
struct OptimizerState {
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::map<std::string, double> scalars;
};

/// Elements [begin, end) of a parameter, in row-major order.
struct ElementRange {
  int64_t begin = 0, end = 0;
};

/// Parameters that share a weight decay: PyTorch's param_groups, for what training recipes set
/// per group (a GPT's norms, biases and embeddings take no decay; weight_decay_groups() makes
/// that split). Each parameter belongs to one group. Only flat shards that hold parts of several
/// groups (FullyShardedDataParallel::param_groups) list `ranges`: ranges[i] is the part of
/// params[i] in this group, and the same shard appears in several groups.
struct ParamGroup {
  std::vector<Tensor> params;
  double weight_decay = 0;
  std::vector<ElementRange> ranges = {};
};

/// {decay, no decay} for a model: parameters with fewer than two dimensions (biases, norm
/// scales) and those of modules named "...Embedding" or "...Norm" get none, the others
/// `weight_decay`. Groups that end up empty are left out.
///
///   optim::AdamW adamw(optim::weight_decay_groups(model, 0.1), {.lr = 6e-4});
std::vector<ParamGroup> weight_decay_groups(const nn::Module& model, double weight_decay);

class Optimizer {
 public:
  /// Every parameter with the weight decay `weight_decay`.
  Optimizer(std::vector<Tensor> params, double lr, double weight_decay = 0);
  /// The parameters of every group (a parameter listed with ranges in several groups once),
  /// each element with its group's weight decay.
  Optimizer(const std::vector<ParamGroup>& groups, double lr);
  virtual ~Optimizer() = default;
  /// Applies one update using the parameters' current gradients (parameters without a
  /// gradient are skipped). Outside backward, raises if communicating autograd nodes (a
  /// differentiable collective's or remote_send's backward) are still pending: their peers
  /// would wait for them, or gradients they should bring would be missing.
  virtual void step() = 0;
  /// Drops (set_to_none) or zeroes every gradient.
  void zero_grad(bool set_to_none = true);
  double lr() const { return lr_; }
  /// The learning rate of the next steps (a capturable optimizer writes it where its steps read
  /// it at once: call it between captured steps, not inside one).
  virtual void set_lr(double lr) { lr_ = lr; }
  const std::vector<Tensor>& params() const { return params_; }
  /// The state tensors created so far (momentum, moment estimates), in a fixed order.
  virtual std::vector<Tensor> state() const { return {}; }
  /// The whole state; the tensors are the live ones, not copies.
  OptimizerState state_dict() const;
  /// Raises, naming the entry, unless `state` fits this optimizer: known names, parameter
  /// indices in range, each tensor with its parameter's shape and dtype, the same parameter
  /// count.
  void check_state_dict(const OptimizerState& state) const;
  /// Replaces the state with copies of `state` (on the parameters' devices), after
  /// check_state_dict: on an error nothing changes.
  void load_state_dict(const OptimizerState& state);

 protected:
  /// The checks every step() makes first: no parameter is managed by a wrapper that trains it
  /// through tensors of its own (FSDP), and no communicating autograd node is pending.
  void check_backward_complete() const;
  /// Per-parameter state vectors by name, indexed like params_ (undefined until created).
  virtual std::vector<std::pair<std::string, std::vector<Tensor>*>> state_slots() { return {}; }
  /// Counters beyond lr (Adam's step count), and setting them from a checked state.
  virtual std::map<std::string, double> counters() const { return {}; }
  virtual void set_counters(const std::map<std::string, double>&) {}
  /// Parameter i's weight decay when it is one number for all its elements (the fused path).
  std::optional<double> uniform_decay(size_t i) const;
  /// L2 decay for a parameter whose parts decay differently: the gradient plus each part's
  /// weight decay times its values (a copy). Decoupled decay: scales each part of p in place.
  Tensor add_part_decay(size_t i, const Tensor& grad) const;
  void decay_parts(size_t i, double lr) const;
  /// Parameter i's elements cut where its weight decay changes: [begin, end) and the decay of
  /// each (0 between parts). A flat shard steps each through the fused kernel as a whole
  /// parameter would, so a step's bits do not depend on where the shards are cut.
  struct DecaySegment {
    int64_t begin, end;
    double weight_decay;
  };
  std::vector<DecaySegment> decay_segments(size_t i) const;

  std::vector<Tensor> params_;
  double lr_;
  struct DecayPart {
    ElementRange range;
    double weight_decay;
  };
  std::vector<std::vector<DecayPart>> decay_;  // per parameter, its parts in element order

  friend class MixedPrecision;  // reaches the wrapped optimizer's state slots and counters
};

struct SGDOptions {
  double lr = 0.01;
  double momentum = 0;
  double dampening = 0;
  double weight_decay = 0;
  bool nesterov = false;
};

/// Stochastic gradient descent with momentum, Nesterov momentum and L2 weight decay, following
/// PyTorch's update rule (the first step stores the gradient as the momentum buffer).
class SGD : public Optimizer {
 public:
  SGD(std::vector<Tensor> params, SGDOptions options);
  /// Each group's weight_decay instead of options.weight_decay.
  SGD(const std::vector<ParamGroup>& groups, SGDOptions options);
  void step() override;
  std::vector<Tensor> state() const override;

 protected:
  std::vector<std::pair<std::string, std::vector<Tensor>*>> state_slots() override {
    return {{"momentum", &momentum_}};
  }

 private:
  SGDOptions options_;
  std::vector<Tensor> momentum_;
};

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;  // Adam: L2 added to the gradient; AdamW: decoupled decay
  /// PyTorch's capturable: the step count, learning rate and bias corrections live on the
  /// parameters' device, and each step counts and reads them there, so a step captured in a
  /// CUDA graph (CapturedStep) replays with each replay's numbers. Takes parameters on one
  /// device, each updated by the fused path (contiguous, a gradient of its dtype, one weight
  /// decay); costs one small launch a step. The same numbers as without it, on either device.
  bool capturable = false;
};

/// Adam (Kingma & Ba) with bias correction.
class Adam : public Optimizer {
 public:
  Adam(std::vector<Tensor> params, AdamOptions options);
  /// Each group's weight_decay instead of options.weight_decay.
  Adam(const std::vector<ParamGroup>& groups, AdamOptions options);
  void step() override;
  std::vector<Tensor> state() const override;
  void set_lr(double lr) override;

 protected:
  Adam(std::vector<Tensor> params, AdamOptions options, bool decoupled);
  Adam(const std::vector<ParamGroup>& groups, AdamOptions options, bool decoupled);
  std::vector<std::pair<std::string, std::vector<Tensor>*>> state_slots() override {
    return {{"exp_avg", &exp_avg_}, {"exp_avg_sq", &exp_avg_sq_}};
  }
  std::map<std::string, double> counters() const override;
  void set_counters(const std::map<std::string, double>& counters) override;

 private:
  /// The capturable step's numbers (made on the first step): {step, lr, c1, c2} on `device`.
  const Tensor& device_scalars(Device device);

  AdamOptions options_;
  bool decoupled_;
  int64_t steps_ = 0;  // with capturable, scalars_[0] counts (replays run no host code)
  std::vector<Tensor> exp_avg_, exp_avg_sq_;
  Tensor scalars_;
};

/// AdamW's options: Adam's, with PyTorch's default decoupled weight decay of 0.01. A field
/// left out of `{.lr = 1e-3}` keeps its default here, whichever way the struct is built.
struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  bool capturable = false;  // as AdamOptions::capturable
};

/// Adam with decoupled weight decay (Loshchilov & Hutter): p -= lr * wd * p before the Adam step.
class AdamW : public Adam {
 public:
  explicit AdamW(std::vector<Tensor> params, AdamWOptions options = {});
  /// Each group's weight_decay instead of options.weight_decay.
  AdamW(const std::vector<ParamGroup>& groups, AdamWOptions options = {});
};

/// Float32 master weights for bfloat16 / float16 parameters. The wrapped optimizer steps float32
/// copies of them; after each step the parameters are set to their masters, rounded. Updates
/// smaller than half a bfloat16 ulp of the weight (lr 1e-4 on a weight of 1 is one: bfloat16
/// has 8 significant bits) accumulate in the master instead of being rounded away. float32 and
/// float64 parameters are their own masters.
///
///   optim::MixedPrecision opt(model.parameters(), [](std::vector<Tensor> masters) {
///     return std::make_unique<optim::AdamW>(std::move(masters), optim::AdamWOptions{});
///   });
///
/// step() widens each gradient into its master's, steps, rounds back; set_lr and the state
/// (for checkpoints: the masters as "master.i", then the wrapped optimizer's) pass through.
class MixedPrecision : public Optimizer {
 public:
  using Factory = std::function<std::unique_ptr<Optimizer>(std::vector<Tensor> masters)>;
  MixedPrecision(std::vector<Tensor> params, const Factory& make_optimizer);
  void step() override;
  void set_lr(double lr) override;
  std::vector<Tensor> state() const override;
  /// Parameter i's float32 master (a float32 or float64 parameter is its own).
  const Tensor& master(size_t i) const { return masters_[i].defined() ? masters_[i] : params_[i]; }
  Optimizer& wrapped() { return *optimizer_; }

 protected:
  std::vector<std::pair<std::string, std::vector<Tensor>*>> state_slots() override;
  std::map<std::string, double> counters() const override { return optimizer_->counters(); }
  void set_counters(const std::map<std::string, double>& counters) override;

 private:
  std::vector<Tensor> masters_;  // undefined where the parameter is its own master
  std::unique_ptr<Optimizer> optimizer_;
};

/// Drops (set_to_none) or zeroes the gradients of `params` (what Optimizer::zero_grad does).
void zero_grad(const std::vector<Tensor>& params, bool set_to_none = true);

/// Scales all gradients so their joint norm is at most max_norm (>= 0; INFINITY only measures);
/// returns the norm before clipping. norm_type may be any p >= 1 or INFINITY. A NaN or infinite
/// norm (a non-finite gradient) raises with error_if_nonfinite; without it, as in PyTorch, the
/// gradients are scaled by NaN or 0 and the returned norm is not finite: check it. A parameter
/// that ranks hold in different pieces (a tensor-parallel slice, a shard, an expert spread over
/// ranks, a pipeline stage's) raises: clip those with parallel::clip_grad_norm_, which reads
/// each parameter's placement (parallel/core/placement.h).
double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type = 2.0,
                       bool error_if_nonfinite = false);
/// clip_grad_norm_ with the host reading nothing: the norm stays where the gradients are (one
/// device), returned as a 0-d float64 tensor, and the scaling reads it there. A step captured
/// in a CUDA graph (CapturedStep) clips this way; read the norm after the step. The same
/// gradients as clip_grad_norm_; a non-finite norm is returned, not raised (check it).
Tensor clip_grad_norm_on_device_(const std::vector<Tensor>& params, double max_norm,
                                 double norm_type = 2.0);

namespace detail {
/// The pieces clip_grad_norm_ is made of, for norms that span processes: the partial norm of
/// the gradients (sum of |g|^p, or max |g| for p = INFINITY), and the scaling step.
double grad_norm_partial(const std::vector<Tensor>& params, double norm_type, const char* op);
/// The same over gradient tensors themselves (undefined ones skipped).
double norm_partial(const std::vector<Tensor>& grads, double norm_type, const char* op);
/// The defined, non-empty tensors of `tensors`, grouped by device in order of first appearance
/// (one fused pass per device).
std::vector<std::pair<Device, std::vector<Tensor>>> by_device(const std::vector<Tensor>& tensors);
/// Raises unless max_norm is a number >= 0 (INFINITY allowed).
void check_max_norm(double max_norm, const char* op);
/// Raises when a parameter is one rank's piece of a parameter spread over ranks (a norm of
/// this rank's pieces alone would not be the model's).
void check_not_spread(const std::vector<Tensor>& params, const char* op);
/// Raises when error_if_nonfinite is set and total_norm is NaN or infinite.
void check_finite_norm(double total_norm, bool error_if_nonfinite, const char* op);
/// Scales every gradient by max_norm / (total_norm + 1e-6) when that is below 1 (or NaN).
void scale_grads_to(const std::vector<Tensor>& params, double max_norm, double total_norm);
}  // namespace detail

}  // namespace weave::optim

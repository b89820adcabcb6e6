#pragma once
// Standard layers.
#include <functional>
#include <initializer_list>

#include "weave/nn/module.h"
#include "weave/ops/activation_checkpoint.h"

namespace weave::nn {

class LowRankAdapter;

/// A low-rank adapter's factors A [rank, in] and B [out, rank] (nn/lora.h), as this rank holds
/// them: leaves that require grad.
struct LowRankFactors {
  Tensor a, b;
};
/// The whole factors of an adapter on a projection [out, in]: A drawn as PEFT draws it
/// (U(+-1/sqrt(in)), nn::Linear's weight) from `generator`, B zero.
LowRankFactors low_rank_factors(int64_t in, int64_t out, int64_t rank, Generator& generator,
                                DType dtype);

/// A layer's linear piece, y = x W^T + b with W [out, in]: nn::Linear whole, or this rank's
/// piece of a linear split over ranks (parallel::ColumnParallelLinear, RowParallelLinear). The
/// layers of nn/ hold their linears as LinearLeaf, so either serves (nn/leaves.h).
class LinearLeaf : public Module {
 public:
  /// Registers "weight" and "bias", both undefined until set_parameters.
  explicit LinearLeaf(std::string name);
  /// x W^T without the bias, for a caller that fuses it with what follows (bias_gelu).
  virtual Tensor forward_unbiased(const Tensor& x) = 0;
  /// An adapter's factors cut as this piece is (whole here; A whole and B's rows split for a
  /// column piece, A's columns split and B whole for a row piece).
  virtual LowRankFactors adapter_factors(int64_t rank, Generator& generator, DType dtype) const;
  Tensor& weight;
  Tensor& bias;  // undefined without bias
  /// The low-rank adapter forward adds (nn/lora.h; owned and registered by the layer that
  /// holds this piece), or null.
  std::shared_ptr<LowRankAdapter> adapter;

 protected:
  /// The parameters' values (leaves that require grad; bias undefined for none).
  void set_parameters(Tensor weight_value, Tensor bias_value);
};

/// y = x W^T + b with W [out, in]; initialized like PyTorch (U(+-1/sqrt(in))).
class Linear : public LinearLeaf {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true,
         Generator* generator = nullptr);
  Tensor forward(const Tensor& x) override;
  Tensor forward_unbiased(const Tensor& x) override;
};

/// Two projections of one input stored stacked: weight [2, width, in] (and bias [2, width]),
/// initialized as one Linear(in, 2 width), so each projection's fan-in is `in`. Gated MLPs
/// (gate and up) and key/value projections keep theirs so: both take one GEMM, and a
/// tensor-parallel split cuts both along width.
struct StackedProjection {
  Tensor weight, bias;  // leaves that require grad; bias undefined without one
};
StackedProjection stacked_projection(int64_t in, int64_t width, bool bias,
                                     Generator* generator = nullptr);
/// x [..., in] -> [..., 2 width] for weight [2, width, in] and bias [2, width] (or undefined):
/// the first projection's outputs, then the second's.
Tensor apply_stacked(const Tensor& x, const Tensor& weight, const Tensor& bias);

/// Lookup table [num_embeddings, dim], initialized N(0, 1).
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t dim, Generator* generator = nullptr);
  /// indices: integer tensor of any shape -> [..., dim].
  Tensor forward(const Tensor& indices) override;
  Tensor& weight;
};

/// Layer normalization over the trailing normalized_shape, with learned scale and shift.
class LayerNorm : public Module {
 public:
  explicit LayerNorm(const Shape& normalized_shape, double eps = 1e-5, bool affine = true);
  Tensor forward(const Tensor& x) override;
  Tensor& weight;  // undefined without affine
  Tensor& bias;

 private:
  Shape shape_;
  double eps_;
};

/// Root-mean-square normalization over the trailing normalized_shape with a learned scale
/// (LLaMA's RMSNorm). With unit_offset the scale is (1 + weight), the weight starting at 0
/// (Gemma's RMSNorm); else the weight, starting at 1.
class RMSNorm : public Module {
 public:
  explicit RMSNorm(const Shape& normalized_shape, double eps = 1e-6, bool affine = true,
                   bool unit_offset = false);
  Tensor forward(const Tensor& x) override;
  Tensor& weight;  // undefined without affine

 private:
  Shape shape_;
  double eps_;
  bool unit_offset_;
};

/// Zeroes elements with probability p in training mode (identity in eval mode).
class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5, Generator* generator = nullptr);
  Tensor forward(const Tensor& x) override;

 private:
  double p_;
  Generator* generator_;
};

/// A stateless function as a module (activations, reshapes).
class Lambda : public Module {
 public:
  Lambda(std::string name, std::function<Tensor(const Tensor&)> fn)
      : Module(std::move(name)), fn_(std::move(fn)) {}
  Tensor forward(const Tensor& x) override { return fn_(x); }

 private:
  std::function<Tensor(const Tensor&)> fn_;
};

std::shared_ptr<Module> ReLU();
std::shared_ptr<Module> GELU();
std::shared_ptr<Module> SiLU();
std::shared_ptr<Module> Tanh();
std::shared_ptr<Module> Sigmoid();
/// Flattens all dims after the first (batch) dim.
std::shared_ptr<Module> Flatten();

/// Runs modules in order; children are named "0", "1", ...
class Sequential : public Module {
 public:
  Sequential() : Module("Sequential") {}
  Sequential(std::initializer_list<std::shared_ptr<Module>> modules);
  /// Children named first_name, first_name + 1, ... (a pipeline stage's share of a model's
  /// layers keeps the names they have in the whole model).
  explicit Sequential(size_t first_name) : Module("Sequential"), first_name_(first_name) {}
  void push_back(std::shared_ptr<Module> module);
  Tensor forward(const Tensor& x) override;
  /// Each module gets the previous one's output with the same side inputs.
  Tensor forward_inputs(const Inputs& inputs) override;
  /// forward_inputs with each module under activation checkpointing (nn::checkpointed): what a
  /// model's recompute_blocks option does with its blocks. The Sequential's own hooks do not run.
  Tensor forward_checkpointed(const Inputs& inputs);
  size_t size() const { return modules_.size(); }
  Module& operator[](size_t i) { return *modules_.at(i); }

 private:
  std::vector<std::shared_ptr<Module>> modules_;
  size_t first_name_ = 0;
};

/// `module` on `inputs` under activation checkpointing (autograd::checkpoint): backward keeps
/// only the input and the side inputs, and runs the module again when it gets there. The module
/// must outlive that backward. What nn::Checkpoint does for a module it owns; this is for a
/// model that decides per call (a flag, a block's index).
Tensor checkpointed(Module& module, const Inputs& inputs,
                    const autograd::CheckpointOptions& options = {});

/// Activation checkpointing of a module (autograd::checkpoint over its forward): backward keeps
/// only the module's input and recomputes the rest when it gets there.
///
///   nn::Sequential model{std::make_shared<nn::Checkpoint>(block0),
///                        std::make_shared<nn::Checkpoint>(block1), head};
///
/// The wrapper adds no name: the wrapped module's parameters keep theirs, so a state dict
/// saved with checkpointing loads without it and back.
class Checkpoint : public Module {
 public:
  explicit Checkpoint(std::shared_ptr<Module> module, autograd::CheckpointOptions options = {});
  Tensor forward(const Tensor& x) override;
  /// The side inputs are kept with the input and given again to the recomputation.
  Tensor forward_inputs(const Inputs& inputs) override;
  Module& wrapped() { return *module_; }

 private:
  std::shared_ptr<Module> module_;
  autograd::CheckpointOptions options_;
};

}  // namespace weave::nn

#pragma once
// Low-rank adapters (LoRA, Hu et al. 2021; Hugging Face PEFT's conventions): a projection
// y = x W^T + b gains a trainable update scale * B A x, with A [rank, in] drawn as PEFT draws it
// (Kaiming-uniform, U(+-1/sqrt(in)): nn::Linear's weight) and B [out, rank] zero, so the model
// starts exactly where the base is. scale is alpha / rank (alpha / sqrt(rank) with rslora). The
// base's parameters are frozen (requires_grad false): backward computes no gradient for them, and
// an optimizer or data-parallel wrapper built on what requires grad holds and moves nothing for
// them.
//
//   auto model = models::from_pretrained("llama/");
//   nn::add_lora(*model, {.rank = 8, .alpha = 16, .targets = {"attention.q", "attention.v"}});
//   optim::AdamW opt(nn::trainable_parameters(*model), {.lr = 2e-4});
//   ... train ...
//   nn::merge_lora(*model);   // W += scale B A in place; the adapters are gone
//
// The layers of nn/ are written once and carry their adapters in any layout: split over a
// tensor-parallel group (nn/leaves.h), an adapter follows Megatron's convention. On a
// column-parallel projection (output features split) A is whole on every rank, its gradient
// summed over the group, and B holds this rank's rows; on a row-parallel one (input features
// split) A holds this rank's columns and B is whole, its gradient summed, and the update's
// partial product joins the base's all-reduce (or reduce-scatter under sequence parallelism).
// Built with the same options, every layout draws the same A: each adapter's factors come from a
// generator seeded by options.seed and the adapter's parameter name, then cut as its projection.
//
// Which projections (PEFT's target_modules, in weave's names): a target matches a projection
// whose path ends with it, on a component boundary. The layers' projections:
//   nn::GroupedQueryAttention  q, k, v, out      (k and v: the halves of the stacked kv)
//   nn::GatedMLP               gate, up, down    (gate and up: the halves of gate_up)
//   nn::MultiheadAttention     qkv, out
//   nn::MLP                    fc1, fc2
// so "attention.q" adapts every block's query projection, "out" both GPT-2's attention output
// and Llama's. models::peft_targets translates Hugging Face's module names. The experts of a
// mixture of experts take none (they may be spread over ranks); its attention layers do.
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "weave/nn/layers.h"

namespace weave::nn {

struct LoRAOptions {
  /// The adapters' rank r.
  int64_t rank = 8;
  /// The update's scale is alpha / rank (alpha / sqrt(rank) with rslora).
  double alpha = 8.0;
  /// Rank-stabilized LoRA's scale, alpha / sqrt(rank) (PEFT's use_rslora).
  bool rslora = false;
  /// Dropout on the adapters' input, in training mode (PEFT's lora_dropout).
  double dropout = 0.0;
  /// The projections to adapt (see above); none matched raises.
  std::vector<std::string> targets = {"q", "v"};
  /// With the parameter names, what draws every adapter's A (and its dropout).
  uint64_t seed = 0;
  /// The adapters' dtype (float32 whatever the base's: a bfloat16 base with float32 adapters
  /// keeps the updates' precision).
  DType dtype = kFloat32;
  /// Freezes every parameter that is no adapter's (requires_grad false).
  bool freeze_base = true;
  double scale() const;
};

/// One projection's adapter: parameters A [rank, in] and B [out, rank] (this rank's pieces when
/// split), as the layer that owns the projection registers it ("q_lora").
class LowRankAdapter : public Module {
 public:
  /// A and B as drawn (and cut); `base` the weight it adapts ([out, in], or a stacked one's
  /// [2, out, in] with `part` its half, -1 for the whole).
  LowRankAdapter(LowRankFactors factors, const LoRAOptions& options, uint64_t seed, Tensor& base,
                 int part);
  /// scale * dropout(x) a^T b^T: the update of the projection's output, with a and b as the
  /// caller reads the factors (a split layer passes the whole factor shared over its ranks).
  Tensor update(const Tensor& x, const Tensor& a, const Tensor& b);
  /// The same with the factors as held.
  Tensor update(const Tensor& x) { return update(x, A, B); }
  double scale() const { return scale_; }
  int64_t rank() const { return A.size(0); }
  /// Adds scale * B A to the base weight this adapter's pieces belong to (this rank's piece of
  /// it, as B A of the pieces is), in place.
  void merge_into_base();
  Tensor& A;
  Tensor& B;

 private:
  double scale_, dropout_;
  Generator generator_;
  Tensor* base_;
  int part_;
};

/// What building one adapter takes, from add_lora to the layer that owns the projection.
struct AdapterSpec {
  const LoRAOptions* options = nullptr;
  /// This adapter's seed (stream_key of options.seed and its parameter name): what draws its A.
  uint64_t seed = 0;
};
/// The adapter of a linear piece, cut as the piece is, attached to it (leaf.adapter), for its
/// layer to register.
std::shared_ptr<LowRankAdapter> adapt_linear(LinearLeaf& leaf, const AdapterSpec& spec);
/// The adapter of half `part` of a stacked projection `base` [2, out, in], its factors made by
/// `factors` (rank, generator, dtype).
std::shared_ptr<LowRankAdapter> adapt_stacked(
    Tensor& base, int part, const AdapterSpec& spec,
    const std::function<LowRankFactors(int64_t, Generator&, DType)>& factors);

/// A layer whose projections take adapters (the four above).
class AdaptedLayer {
 public:
  virtual ~AdaptedLayer() = default;
  /// Its projections' names ("q", "k", "v", "out").
  virtual std::vector<std::string> projections() const = 0;
  /// Builds projection `name`'s adapter (cut as the projection is), registers it as
  /// "<name>_lora" and applies it from the next forward on. Raises if it has one already.
  virtual void adapt(const std::string& name, const AdapterSpec& spec) = 0;
  /// Forgets every adapter it applies (merge_lora then unregisters them).
  virtual void drop_adapters() = 0;
};

/// Adapters on the projections of `model` that `options.targets` name, and (freeze_base) every
/// other parameter frozen. Raises, naming the target, for one that matches no projection (unless
/// not every_target: a pipeline stage holds some of the blocks that full paths name), and for a
/// model that already has adapters; then the model is unchanged. Returns how many projections it
/// adapted.
int64_t add_lora(Module& model, const LoRAOptions& options, bool every_target = true);

/// Every adapter of `model` by its parameter prefix ("blocks.0.attention.q_lora").
std::vector<std::pair<std::string, LowRankAdapter*>> lora_adapters(const Module& model);

/// Folds every adapter into its base weight (W += scale B A, computed in float64 and rounded once
/// to W's dtype) and removes the adapters: what remains is the plain model. Collective-free: each
/// rank merges its pieces.
void merge_lora(Module& model);

/// The adapters' two halves of a stacked projection (gate and up, key and value): null for none.
using StackedAdapters = std::array<LowRankAdapter*, 2>;
/// y [..., 2 w], a stacked projection's output for input x, with each half's adapter update
/// added; `a_of` and `b_of` give the factors as this rank reads them (whole: as held).
Tensor add_stacked_updates(const Tensor& y, const Tensor& x, const StackedAdapters& adapters,
                           const std::function<Tensor(const Tensor&)>& a_of,
                           const std::function<Tensor(const Tensor&)>& b_of);

}  // namespace weave::nn

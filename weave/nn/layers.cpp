#include "weave/nn/layers.h"

#include <cmath>

#include "weave/autograd/grad_mode.h"
#include "weave/nn/deferred.h"
#include "weave/nn/init.h"
#include "weave/nn/lora.h"

namespace weave::nn {

namespace {
// A parameter holding U(-bound, bound).
Tensor uniform_bound(const Shape& shape, double bound, Generator* generator) {
  return init::uniform_parameter(shape, -bound, bound, generator);
}
}  // namespace

LinearLeaf::LinearLeaf(std::string name)
    : Module(std::move(name)),
      weight(register_parameter("weight", Tensor())),
      bias(register_parameter("bias", Tensor())) {}

void LinearLeaf::set_parameters(Tensor weight_value, Tensor bias_value) {
  weight = register_value(std::move(weight_value), "weight");
  bias = register_value(std::move(bias_value), "bias");
}

Linear::Linear(int64_t in_features, int64_t out_features, bool with_bias, Generator* generator)
    : LinearLeaf("Linear") {
  WEAVE_CHECK(in_features > 0 && out_features > 0, "Linear",
              "feature counts must be positive, found in={} out={}", in_features, out_features);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  Tensor w = uniform_bound({out_features, in_features}, bound, generator);  // drawn first
  set_parameters(std::move(w),
                 with_bias ? uniform_bound({out_features}, bound, generator) : Tensor());
}

LowRankFactors low_rank_factors(int64_t in, int64_t out, int64_t rank, Generator& generator,
                                DType dtype) {
  WEAVE_CHECK(rank > 0 && in > 0 && out > 0, "LoRA",
              "the rank ({}) of an adapter on a [{}, {}] projection must be positive", rank, out,
              in);
  NoGradGuard no_grad;
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  Tensor a = empty({rank, in}, {.dtype = dtype});
  init::uniform_(a, -bound, bound, &generator);
  Tensor b = zeros({out, rank}, {.dtype = dtype});
  return {a.requires_grad_(true), b.requires_grad_(true)};
}

LowRankFactors LinearLeaf::adapter_factors(int64_t rank, Generator& generator, DType dtype) const {
  return low_rank_factors(weight.size(1), weight.size(0), rank, generator, dtype);
}

Tensor Linear::forward(const Tensor& x) {
  Tensor y = linear(x, weight, bias);
  return adapter ? y + adapter->update(x) : y;
}

Tensor Linear::forward_unbiased(const Tensor& x) {
  Tensor y = linear(x, weight);
  return adapter ? y + adapter->update(x) : y;
}

StackedProjection stacked_projection(int64_t in, int64_t width, bool bias, Generator* generator) {
  Linear fused(in, 2 * width, bias, generator);
  StackedProjection p;
  p.weight = fused.weight.detach().reshape({2, width, in}).requires_grad_(true);
  if (bias) p.bias = fused.bias.detach().reshape({2, width}).requires_grad_(true);
  return p;
}

Tensor apply_stacked(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  const int64_t rows = weight.size(0) * weight.size(1);
  return linear(x, weight.reshape({rows, weight.size(2)}),
                bias.defined() ? bias.reshape({rows}) : Tensor());
}

Embedding::Embedding(int64_t num_embeddings, int64_t dim, Generator* generator)
    : Module("Embedding"),
      weight(register_parameter("weight",
                                init::normal_parameter({num_embeddings, dim}, 0, 1, generator))) {}

Tensor Embedding::forward(const Tensor& indices) {
  return embedding(weight, indices);
}

LayerNorm::LayerNorm(const Shape& normalized_shape, double eps, bool affine)
    : Module("LayerNorm"),
      weight(register_parameter("weight",
                                affine ? init::constant_parameter(normalized_shape, 1) : Tensor())),
      bias(register_parameter("bias",
                              affine ? init::constant_parameter(normalized_shape, 0) : Tensor())),
      shape_(normalized_shape),
      eps_(eps) {}

Tensor LayerNorm::forward(const Tensor& x) {
  return layer_norm(x, shape_, weight, bias, eps_);
}

RMSNorm::RMSNorm(const Shape& normalized_shape, double eps, bool affine, bool unit_offset)
    : Module("RMSNorm"),
      weight(register_parameter(
          "weight",
          affine ? init::constant_parameter(normalized_shape, unit_offset ? 0 : 1) : Tensor())),
      shape_(normalized_shape),
      eps_(eps),
      unit_offset_(unit_offset) {
  WEAVE_CHECK(affine || !unit_offset, "RMSNorm",
              "unit_offset scales by (1 + weight): it needs affine");
}

Tensor RMSNorm::forward(const Tensor& x) {
  return rms_norm(x, shape_, unit_offset_ ? weight + 1.0 : weight, eps_);
}

Dropout::Dropout(double p, Generator* generator) : Module("Dropout"), p_(p), generator_(generator) {
  WEAVE_CHECK(p >= 0 && p <= 1, "Dropout", "probability must be in [0, 1], found {}", p);
}

Tensor Dropout::forward(const Tensor& x) {
  return dropout(x, p_, is_training(), generator_);
}

std::shared_ptr<Module> ReLU() {
  return std::make_shared<Lambda>("ReLU", [](const Tensor& x) { return relu(x); });
}
std::shared_ptr<Module> GELU() {
  return std::make_shared<Lambda>("GELU", [](const Tensor& x) { return gelu(x); });
}
std::shared_ptr<Module> SiLU() {
  return std::make_shared<Lambda>("SiLU", [](const Tensor& x) { return silu(x); });
}
std::shared_ptr<Module> Tanh() {
  return std::make_shared<Lambda>("Tanh", [](const Tensor& x) { return tanh(x); });
}
std::shared_ptr<Module> Sigmoid() {
  return std::make_shared<Lambda>("Sigmoid", [](const Tensor& x) { return sigmoid(x); });
}
std::shared_ptr<Module> Flatten() {
  return std::make_shared<Lambda>("Flatten", [](const Tensor& x) { return x.flatten(1); });
}

Sequential::Sequential(std::initializer_list<std::shared_ptr<Module>> modules) : Sequential() {
  for (const auto& m : modules) push_back(m);
}

void Sequential::push_back(std::shared_ptr<Module> module) {
  WEAVE_CHECK(module != nullptr, "Sequential", "cannot add a null module");
  modules_.push_back(
      register_module(std::to_string(first_name_ + modules_.size()), std::move(module)));
}

Tensor Sequential::forward(const Tensor& x) {
  return forward_inputs(Inputs(x));
}

Tensor Sequential::forward_inputs(const Inputs& inputs) {
  Tensor y = inputs.x;
  for (auto& m : modules_) y = (*m)(inputs.with(y));
  return y;
}

Tensor Sequential::forward_checkpointed(const Inputs& inputs) {
  Tensor y = inputs.x;
  for (auto& m : modules_) y = checkpointed(*m, inputs.with(y));
  return y;
}

Checkpoint::Checkpoint(std::shared_ptr<Module> module, autograd::CheckpointOptions options)
    : Module("Checkpoint"), module_(std::move(module)), options_(std::move(options)) {
  register_wrapped_module(module_);
}

Tensor Checkpoint::forward(const Tensor& x) {
  return forward_inputs(Inputs(x));
}

Tensor checkpointed(Module& module, const Inputs& inputs,
                    const autograd::CheckpointOptions& options) {
  // The recomputation runs in backward, after this call: it keeps its own side inputs.
  return autograd::checkpoint([&module, side = inputs.with(Tensor())](
                                  const Tensor& input) { return module(side.with(input)); },
                              inputs.x, options);
}

Tensor Checkpoint::forward_inputs(const Inputs& inputs) {
  return checkpointed(*module_, inputs, options_);
}

}  // namespace weave::nn

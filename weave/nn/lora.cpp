// Low-rank adapters: the adapter, attaching adapters by target, merging them away.
#include "weave/nn/lora.h"

#include <cmath>
#include <map>
#include <set>
#include <tuple>

#include "weave/autograd/grad_mode.h"
#include "weave/nn/moe.h"

namespace weave::nn {

namespace {

constexpr const char* kLoRA = "LoRA";

// Whether visit_modules goes into a module: not into a mixture of experts (whose experts may be
// spread over ranks, each rank's own: their adapters would need the experts' placement, which
// they do not carry).
bool outside_experts(Module& module) {
  return dynamic_cast<MoE*>(&module) == nullptr;
}

// Whether `target` names `path`: path ends with it, on a component boundary.
bool names(const std::string& target, const std::string& path) {
  if (target.empty() || target.size() > path.size()) return false;
  if (path.compare(path.size() - target.size(), target.size(), target) != 0) return false;
  return target.size() == path.size() || path[path.size() - target.size() - 1] == '.';
}

void check_options(const LoRAOptions& options) {
  WEAVE_CHECK(options.rank > 0, kLoRA, "rank must be positive, found {}", options.rank);
  WEAVE_CHECK(std::isfinite(options.alpha) && options.alpha > 0, kLoRA,
              "alpha must be positive and finite, found {}", options.alpha);
  WEAVE_CHECK(options.dropout >= 0 && options.dropout < 1, kLoRA,
              "dropout must lie in [0, 1), found {}", options.dropout);
  WEAVE_CHECK(is_floating(options.dtype), kLoRA, "the adapters' dtype must be floating, found {}",
              options.dtype);
  WEAVE_CHECK(!options.targets.empty(), kLoRA,
              "no targets; hint: name the projections to adapt, as {{\"q\", \"v\"}}");
}

}  // namespace

double LoRAOptions::scale() const {
  return rslora ? alpha / std::sqrt(double(rank)) : alpha / double(rank);
}

LowRankAdapter::LowRankAdapter(LowRankFactors factors, const LoRAOptions& options, uint64_t seed,
                               Tensor& base, int part)
    : Module("LowRankAdapter"),
      A(register_parameter("A", std::move(factors.a))),
      B(register_parameter("B", std::move(factors.b))),
      scale_(options.scale()),
      dropout_(options.dropout),
      generator_(seed ^ 0xd50f5eedULL),
      base_(&base),
      part_(part) {}

Tensor LowRankAdapter::update(const Tensor& x, const Tensor& a, const Tensor& b) {
  const Tensor input = dropout_ > 0 ? dropout(x, dropout_, is_training(), &generator_) : x;
  // In the activations' dtype (a bfloat16 base's under float32 adapters: the factors are cast,
  // their gradients flow back to them in float32), so that no wider copy of x is kept for
  // backward; scaled at the rank's width, the narrowest.
  const DType dtype = x.dtype();
  auto as_input = [dtype](const Tensor& factor) {
    return factor.dtype() == dtype ? factor : factor.to(dtype);
  };
  return linear(linear(input, as_input(a)) * scale_, as_input(b));
}

void LowRankAdapter::merge_into_base() {
  NoGradGuard no_grad;
  Tensor weight = part_ < 0 ? *base_ : base_->select(0, part_);
  const Tensor delta = matmul(B.detach().to(kFloat64), A.detach().to(kFloat64)) * scale_;
  WEAVE_CHECK(delta.shape() == weight.shape(), kLoRA,
              "an adapter's B A is {}, its base weight {}; hint: merge the model the adapters "
              "were added to, before wrapping it",
              delta.shape(), weight.shape());
  weight.copy_((weight.detach().to(kFloat64) + delta).to(weight.dtype()));
}

std::shared_ptr<LowRankAdapter> adapt_linear(LinearLeaf& leaf, const AdapterSpec& spec) {
  WEAVE_CHECK(leaf.adapter == nullptr, kLoRA, "the projection has an adapter already");
  Generator generator(spec.seed);
  leaf.adapter = std::make_shared<LowRankAdapter>(
      leaf.adapter_factors(spec.options->rank, generator, spec.options->dtype), *spec.options,
      spec.seed, leaf.weight, -1);
  return leaf.adapter;
}

std::shared_ptr<LowRankAdapter> adapt_stacked(
    Tensor& base, int part, const AdapterSpec& spec,
    const std::function<LowRankFactors(int64_t, Generator&, DType)>& factors) {
  Generator generator(spec.seed);
  return std::make_shared<LowRankAdapter>(
      factors(spec.options->rank, generator, spec.options->dtype), *spec.options, spec.seed, base,
      part);
}

int64_t add_lora(Module& model, const LoRAOptions& options, bool every_target) {
  check_options(options);
  WEAVE_CHECK(lora_adapters(model).empty(), kLoRA,
              "the model has adapters already; hint: merge_lora first, or add all targets in one "
              "call");
  // Every target must match before anything changes: a bad list leaves the model as it was.
  std::set<std::string> matched;
  std::vector<std::tuple<AdaptedLayer*, std::string, std::string>> chosen;
  visit_modules(
      model,
      [&](Module& module, const std::string& path) {
        auto* layer = dynamic_cast<AdaptedLayer*>(&module);
        if (layer == nullptr) return;
        for (const std::string& projection : layer->projections()) {
          const std::string full = path.empty() ? projection : path + "." + projection;
          bool hit = false;
          for (const std::string& target : options.targets)
            if (names(target, full)) hit = true, matched.insert(target);
          if (hit) chosen.emplace_back(layer, projection, full);
        }
      },
      outside_experts);
  for (const std::string& target : options.targets)
    WEAVE_CHECK(!every_target || matched.count(target) != 0, kLoRA,
                "target '{}' names no projection of the model; hint: the projections are "
                "attention's q, k, v, out (qkv, out for GPT-2's) and the MLP's gate, up, down "
                "(fc1, fc2; not a mixture of experts'), named by their path's end "
                "(\"attention.q\", \"mlp.down\")",
                target);
  for (const auto& [layer, projection, full] : chosen)
    // The stream nn::DeferredInit would draw the adapter's parameters from: alike in every layout.
    layer->adapt(projection,
                 {.options = &options, .seed = stream_key(options.seed, full + "_lora")});
  if (options.freeze_base) {
    std::set<const void*> adapters;
    for (const auto& [name, adapter] : lora_adapters(model))
      adapters.insert(adapter->A.impl()), adapters.insert(adapter->B.impl());
    for (Tensor& p : model.parameters())
      if (!adapters.count(p.impl())) p.requires_grad_(false);
  }
  return int64_t(chosen.size());
}

std::vector<std::pair<std::string, LowRankAdapter*>> lora_adapters(const Module& model) {
  std::vector<std::pair<std::string, LowRankAdapter*>> out;
  visit_modules(const_cast<Module&>(model), [&](Module& module, const std::string& path) {
    if (auto* adapter = dynamic_cast<LowRankAdapter*>(&module)) out.emplace_back(path, adapter);
  });
  return out;
}

void merge_lora(Module& model) {
  const auto adapters = lora_adapters(model);
  WEAVE_CHECK(!adapters.empty(), kLoRA, "the model has no adapters to merge");
  for (const auto& [name, adapter] : adapters) adapter->merge_into_base();
  visit_modules(model, [](Module& module, const std::string&) {
    auto* layer = dynamic_cast<AdaptedLayer*>(&module);
    if (layer == nullptr) return;
    layer->drop_adapters();
    std::vector<std::string> gone;
    for (const auto& [name, child] : module.named_children())
      if (dynamic_cast<LowRankAdapter*>(child.get())) gone.push_back(name);
    for (const std::string& name : gone) module.unregister_module(name);
  });
}

Tensor add_stacked_updates(const Tensor& y, const Tensor& x, const StackedAdapters& adapters,
                           const std::function<Tensor(const Tensor&)>& a_of,
                           const std::function<Tensor(const Tensor&)>& b_of) {
  if (adapters[0] == nullptr && adapters[1] == nullptr) return y;
  const int64_t width = y.size(-1) / 2;
  std::vector<Tensor> halves;
  for (int part = 0; part < 2; ++part) {
    Tensor half = y.narrow(-1, part * width, width);
    if (LowRankAdapter* adapter = adapters[size_t(part)])
      half = half + adapter->update(x, a_of(adapter->A), b_of(adapter->B));
    halves.push_back(half);
  }
  return cat(halves, -1);
}

}  // namespace weave::nn

// Low-rank adapters on one process: an adapted Llama (grouped-query attention, gated MLP) and
// GPT-2 (fused qkv, MLP) against the same models with W + scale B A written into their weights by
// hand (float64), gradients against finite differences, the frozen base, merging, and bad input.
#include <cmath>
#include <map>

#include "helpers.h"

using namespace weave;
using weave::test::relative_error;

namespace {

models::LlamaOptions small_llama() {
  return {.vocab = 16,
          .dim = 16,
          .layers = 2,
          .block = {.heads = 4, .kv_heads = 2, .hidden = 24, .qkv_bias = true}};
}

models::GPT2Options small_gpt2() {
  return {.vocab = 16, .dim = 16, .layers = 2, .heads = 4, .max_positions = 8};
}

template <class Model, class Options>
std::shared_ptr<Model> build(const Options& options, uint64_t seed) {
  manual_seed(seed);
  auto model = std::make_shared<Model>(options);
  model->to(kFloat64);
  return model;
}

// Every adapter's B drawn at random (they start at zero, which would test nothing).
void randomize_adapters(nn::Module& model, uint64_t seed) {
  Generator g(seed);
  NoGradGuard no_grad;
  for (const auto& [name, adapter] : nn::lora_adapters(model))
    adapter->B.copy_(randn(adapter->B.shape(), {.dtype = adapter->B.dtype()}, &g) * 0.3);
}

// The weight an adapter's update belongs to, by the test's own reading of the names: the
// projection's weight, or the half of a stacked one.
struct Target {
  std::string weight;
  int part;  // -1: whole
};
Target target_of(const std::string& adapter) {
  const std::string layer = adapter.substr(0, adapter.rfind('.') + 1);
  const std::string site = adapter.substr(layer.size(), adapter.size() - layer.size() - 5);
  if (site == "k" || site == "v") return {layer + "kv", site == "k" ? 0 : 1};
  if (site == "gate" || site == "up") return {layer + "gate_up", site == "gate" ? 0 : 1};
  return {layer + site + ".weight", -1};
}

// `plain`'s weights become W + scale B A for every adapter of `adapted` (written here from the
// formula, not by merge_lora).
void write_updates_by_hand(const nn::Module& adapted, nn::Module& plain, double scale) {
  std::map<std::string, Tensor> params;
  for (const auto& [name, p] : plain.named_parameters()) params[name] = p;
  NoGradGuard no_grad;
  for (const auto& [name, adapter] : nn::lora_adapters(adapted)) {
    const Target t = target_of(name);
    const std::string parameter = name;  // a lambda cannot capture a binding
    CAPTURE(parameter);
    REQUIRE(params.contains(t.weight));
    Tensor w = t.part < 0 ? params.at(t.weight) : params.at(t.weight).select(0, t.part);
    w.add_(matmul(adapter->B, adapter->A) * scale);
  }
}

Tensor tokens_of(uint64_t seed) {
  Generator g(seed);
  return randint(0, 16, {2, 6}, {.dtype = kInt64}, &g);
}

template <class Model, class Options>
void check_adapted_equals_updated_weights(const Options& options,
                                          const std::vector<std::string>& targets,
                                          int64_t expected_adapters) {
  auto adapted = build<Model>(options, 7);
  const nn::LoRAOptions lora{
      .rank = 3, .alpha = 6, .rslora = true, .targets = targets, .dtype = kFloat64};
  CHECK(nn::add_lora(*adapted, lora) == expected_adapters);
  randomize_adapters(*adapted, 11);
  auto updated = build<Model>(options, 7);
  CHECK(lora.scale() == doctest::Approx(6 / std::sqrt(3.0)));
  write_updates_by_hand(*adapted, *updated, lora.scale());
  const Tensor tokens = tokens_of(3);
  const Tensor expected = (*updated)(tokens);
  CHECK(relative_error((*adapted)(tokens), expected) < 1e-13);
  // Without the adapters' updates the outputs differ: the check above sees them.
  auto base = build<Model>(options, 7);
  CHECK(relative_error((*base)(tokens), expected) > 1e-3);
  // Merged, the adapters are gone and the weights are the hand-written ones.
  nn::merge_lora(*adapted);
  CHECK(nn::lora_adapters(*adapted).empty());
  CHECK(adapted->state_dict().size() == updated->state_dict().size());
  CHECK(relative_error((*adapted)(tokens), expected) < 1e-13);
}

}  // namespace

TEST_SUITE("lora") {
  TEST_CASE("an adapted Llama equals the Llama whose weights are W + scale B A") {
    check_adapted_equals_updated_weights<models::Llama>(
        small_llama(), {"q", "k", "v", "out", "gate", "up", "down"}, 2 * 7);
    check_adapted_equals_updated_weights<models::Llama>(small_llama(), {"attention.k", "mlp.up"},
                                                        2 * 2);
  }

  TEST_CASE("an adapted GPT-2 equals the GPT-2 whose weights are W + scale B A") {
    check_adapted_equals_updated_weights<models::GPT2>(small_gpt2(), {"qkv", "out", "fc1", "fc2"},
                                                       2 * 4);
    check_adapted_equals_updated_weights<models::GPT2>(small_gpt2(), {"blocks.1.mlp.fc2"}, 1);
  }

  TEST_CASE("the base is frozen: no gradient; the adapters' gradients match finite differences") {
    auto model = build<models::Llama>(small_llama(), 5);
    nn::add_lora(*model, {.rank = 2, .targets = {"q", "v", "down", "gate"}, .dtype = kFloat64});
    randomize_adapters(*model, 13);
    const Tensor tokens = tokens_of(4);
    std::vector<Tensor> factors;
    for (const auto& [name, adapter] : nn::lora_adapters(*model))
      factors.push_back(adapter->A), factors.push_back(adapter->B);
    CHECK(factors.size() == 2 * 2 * 4);
    CHECK(nn::trainable_parameters(*model).size() == factors.size());
    const auto result =
        autograd::gradcheck([&](const std::vector<Tensor>&) { return (*model)(tokens); }, factors);
    CHECK(result.ok);
    CHECK(result.checked > 200);
    model->zero_grad();
    cross_entropy((*model)(tokens).reshape({-1, 16}), tokens.reshape({-1})).backward();
    for (const auto& [name, p] : model->named_parameters()) {
      const std::string parameter = name;  // a lambda cannot capture a binding
      CAPTURE(parameter);
      const bool adapter = name.find("_lora.") != std::string::npos;
      CHECK(p.requires_grad() == adapter);
      CHECK(p.grad().defined() == adapter);
    }
    const nn::ParameterCount count = nn::count_parameters(*model);
    const int64_t adapters = 2 * (2 * (16 + 16) + 2 * (16 + 8) + 2 * (24 + 16) + 2 * (16 + 24));
    CHECK(count.trainable == adapters);
    CHECK(adapters == 544);
    CHECK(nn::summary(*model).find("544 trainable, ") != std::string::npos);
    std::string frozen = std::to_string(count.total - adapters);
    for (int at = int(frozen.size()) - 3; at > 0; at -= 3) frozen.insert(size_t(at), ",");
    CHECK(nn::summary(*model).find("544 trainable, " + frozen + " frozen") != std::string::npos);
  }

  TEST_CASE("every layout draws an adapter's A alike: by its seed and name, not by its order") {
    auto one = build<models::Llama>(small_llama(), 1);
    auto two = build<models::Llama>(small_llama(), 2);  // other base weights
    nn::add_lora(*one, {.targets = {"q", "v"}, .seed = 4});
    nn::add_lora(*two, {.targets = {"v"}, .seed = 4});
    std::map<std::string, Tensor> first;
    for (const auto& [name, adapter] : nn::lora_adapters(*one)) first[name] = adapter->A;
    for (const auto& [name, adapter] : nn::lora_adapters(*two)) {
      const std::string parameter = name;  // a lambda cannot capture a binding
      CAPTURE(parameter);
      CHECK(equal(adapter->A, first.at(name)));
      CHECK(equal(adapter->B, zeros_like(adapter->B)));
      const double bound = 1 / std::sqrt(16.0);  // PEFT's A: U(+-1/sqrt(in))
      CHECK(max(abs(adapter->A)).item<double>() <= bound);
      CHECK(max(abs(adapter->A)).item<double>() > 0.8 * bound);
    }
    CHECK(!equal(first.at("blocks.0.attention.q_lora"), first.at("blocks.1.attention.q_lora")));
  }

  TEST_CASE("adapter dropout drops in training and not in eval") {
    auto model = build<models::Llama>(small_llama(), 3);
    nn::add_lora(*model, {.rank = 2, .dropout = 0.5, .targets = {"q"}, .dtype = kFloat64});
    randomize_adapters(*model, 5);
    const Tensor tokens = tokens_of(6);
    model->eval();
    const Tensor eval = (*model)(tokens);
    auto updated = build<models::Llama>(small_llama(), 3);
    write_updates_by_hand(*model, *updated, 8.0 / 2);
    CHECK(relative_error(eval, (*updated)(tokens)) < 1e-13);
    model->train();
    CHECK(relative_error((*model)(tokens), eval) > 1e-6);
  }

  TEST_CASE("a bfloat16 base under float32 adapters: their gradients and AdamW's state float32") {
    auto model = build<models::Llama>(small_llama(), 9);
    model->to(kBFloat16);
    nn::add_lora(*model, {.rank = 2, .alpha = 4, .targets = {"q", "v", "down", "up"}});
    randomize_adapters(*model, 17);
    // The truth: the same bfloat16 weights and float32 adapters, computed in float64.
    auto wide = build<models::Llama>(small_llama(), 9);
    wide->load_state_dict(model->state_dict(), /*strict=*/false);
    nn::add_lora(*wide,
                 {.rank = 2, .alpha = 4, .targets = {"q", "v", "down", "up"}, .dtype = kFloat64});
    wide->load_state_dict(model->state_dict());
    const Tensor tokens = tokens_of(8);
    const Tensor logits = (*model)(tokens);
    CHECK(logits.dtype() == kBFloat16);
    const Tensor expected = (*wide)(tokens);
    CHECK(relative_error(logits.to(kFloat64), expected) < 3e-2);
    auto base = build<models::Llama>(small_llama(), 9);
    base->load_state_dict(model->state_dict(), /*strict=*/false);
    CHECK(relative_error((*base)(tokens), expected) > 0.1);  // the adapters' part is seen
    optim::AdamW opt(nn::trainable_parameters(*model), {.lr = 0.01});
    cross_entropy(logits.to(kFloat32).reshape({-1, 16}), tokens.reshape({-1})).backward();
    opt.step();
    int64_t state_bytes = 0;
    for (const Tensor& t : opt.state()) {
      CHECK(t.dtype() == kFloat32);
      state_bytes += t.numel() * int64_t(t.itemsize());
    }
    int64_t adapter_bytes = 0;
    for (const auto& [name, p] : model->named_parameters()) {
      const std::string parameter = name;  // a lambda cannot capture a binding
      CAPTURE(parameter);
      const bool adapter = name.find("_lora.") != std::string::npos;
      CHECK(p.dtype() == (adapter ? kFloat32 : kBFloat16));
      CHECK(p.grad().defined() == adapter);
      if (!adapter) continue;
      adapter_bytes += p.numel() * 4;
      CHECK(p.grad().dtype() == kFloat32);
    }
    CHECK(state_bytes == 2 * adapter_bytes);  // two moments, of the adapters only
  }

  TEST_CASE("bad targets, a second add_lora and bad options raise, naming what is wrong") {
    auto model = build<models::Llama>(small_llama(), 3);
    CHECK_THROWS_WITH_AS(nn::add_lora(*model, {.targets = {"q", "q_proj"}}),
                         doctest::Contains("target 'q_proj' names no projection"), Error);
    CHECK(nn::lora_adapters(*model).empty());  // nothing changed
    nn::add_lora(*model, {.targets = {"q"}});
    CHECK_THROWS_WITH_AS(nn::add_lora(*model, {.targets = {"v"}}),
                         doctest::Contains("has adapters already"), Error);
    auto fresh = build<models::Llama>(small_llama(), 3);
    CHECK_THROWS_WITH_AS(nn::add_lora(*fresh, {.rank = 0}), doctest::Contains("rank"), Error);
    CHECK_THROWS_WITH_AS(nn::add_lora(*fresh, {.dropout = 1.0}), doctest::Contains("dropout"),
                         Error);
    CHECK_THROWS_WITH_AS(nn::add_lora(*fresh, {.targets = {}}), doctest::Contains("no targets"),
                         Error);
    CHECK_THROWS_WITH_AS(nn::merge_lora(*fresh), doctest::Contains("no adapters"), Error);
    CHECK(nn::lora_adapters(*fresh).empty());
    for (const Tensor& p : fresh->parameters()) CHECK(p.requires_grad());
  }
}

// Low-rank adapters on every axis: a Llama (grouped-query attention: key/value heads split, or
// replicated when fewer than the tensor ranks) and a GPT-2, adapters on every projection, on
// whatever layouts the world allows (tensor, data, fully sharded, hybrid sharded, pipeline and
// context parallel, and their products at 4 ranks), each trained 3 AdamW steps with clipping in
// float64 against one process that trains the same adapted model on the whole batch: the loss,
// the clipped norm and every adapter parameter within 1e-10; the frozen base bit-identical to
// what was loaded, holding no gradient.
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <optional>
#include <string>
#include <type_traits>

#include "helpers.h"
#include "model_parallel_helpers.h"
#include "weave/weave.h"

using namespace weave;

namespace {

constexpr int64_t kVocab = 16, kRows = 2, kLength = 8;
constexpr double kMaxNorm = 0.05;
constexpr optim::AdamWOptions kAdamW{.lr = 0.02, .weight_decay = 0.01};

struct Layout {
  const char* name;
  parallel::MeshShape shape;
  bool shard = false;  // FSDP (HSDP with shape.replicate)
  bool sequence_parallel = false;
};

// The layouts of the world's size.
std::vector<Layout> layouts() {
  switch (dist::world_size()) {
    case 1:
      return {{"one process", {}}};
    case 2:
      return {{"tensor 2", {.tensor = 2}},
              {"tensor 2, sequence parallel", {.tensor = 2}, false, true},
              {"data 2", {.data = 2}},
              {"fully sharded 2", {.data = 2}, true},
              {"pipeline 2", {.pipeline = 2}},
              {"context 2", {.context = 2}}};
    case 3:
      return {{"data 3", {.data = 3}}, {"fully sharded 3", {.data = 3}, true}};
    default:
      return {{"hybrid sharded 2 x 2", {.data = 4, .replicate = 2}, true},
              {"fully sharded 2 x tensor 2", {.data = 2, .tensor = 2}, true},
              {"pipeline 2 x tensor 2", {.tensor = 2, .pipeline = 2}},
              {"context 2 x data 2 (fully sharded)", {.data = 2, .context = 2}, true},
              {"pipeline 2 x data 2", {.data = 2, .pipeline = 2}}};
  }
}

// The layouts with experts spread over the data ranks.
std::vector<Layout> expert_layouts() {
  switch (dist::world_size()) {
    case 1:
      return {{"one process", {}}};
    case 2:
      return {{"experts 2 over data 2", {.data = 2, .expert = 2}},
              {"experts 2 over fully sharded 2", {.data = 2, .expert = 2}, true}};
    case 4:
      return {{"experts 2 x data 2 x tensor 2", {.data = 2, .tensor = 2, .expert = 2}}};
    default:
      return {};
  }
}

// kv_heads < 0: a Llama whose MLPs are mixtures of 4 experts (top 2), with kv_heads 2.
template <class Model>
auto options_of(int64_t kv_heads) {
  if constexpr (std::is_same_v<Model, models::Llama>) {
    models::LlamaOptions options{
        .vocab = kVocab,
        .dim = 16,
        .layers = 2,
        .block = {.heads = 4, .kv_heads = std::abs(kv_heads), .hidden = 24, .qkv_bias = true}};
    if (kv_heads < 0)
      options.block.moe = nn::MoEOptions{
          .hidden = 16, .ffn = 12, .router = {.experts = 4, .top_k = 2, .aux_loss_coef = 0.1}};
    return options;
  } else
    return models::GPT2Options{
        .vocab = kVocab, .dim = 16, .layers = 2, .heads = 4, .max_positions = 16};
}

template <class Model>
nn::LoRAOptions lora_of(bool experts) {
  std::vector<std::string> targets = {"q", "k", "v", "out", "gate", "up", "down"};
  if constexpr (!std::is_same_v<Model, models::Llama>) targets = {"qkv", "out", "fc1", "fc2"};
  if (experts) targets = {"q", "k", "v", "out"};
  return {.rank = 2, .alpha = 4, .dropout = 0, .targets = targets, .seed = 3, .dtype = kFloat64};
}

// The parameters by name, cloned.
std::map<std::string, Tensor> values_of(const nn::NamedTensors& named) {
  std::map<std::string, Tensor> out;
  for (const auto& [name, t] : named) out[name] = t.detach().clone();
  return out;
}

template <class Model>
void check_layout(const Layout& layout, int64_t kv_heads) {
  if (layout.sequence_parallel && std::is_same_v<Model, models::Llama>) return;  // GPT-2's alone
  const std::string name = layout.name;
  CAPTURE(name);
  CAPTURE(kv_heads);
  const auto options = options_of<Model>(kv_heads);
  manual_seed(21);
  Model reference(options);
  reference.to(kFloat64);
  const nn::NamedTensors base = reference.state_dict();
  const bool experts = kv_heads < 0;
  nn::add_lora(reference, lora_of<Model>(experts));

  parallel::ProcessMesh mesh(layout.shape);
  const models::ModelSplit parts =
      models::ModelSplit::from_mesh(mesh, {.sequence_parallel = layout.sequence_parallel});
  Model model(options, parts);
  model.to(kFloat64);
  {  // this rank's pieces of the reference's base (a stage's own draws would differ)
    nn::NamedTensors state = parallel::shard_state_dict(base, model);
    const auto mine = values_of(model.state_dict());
    std::erase_if(state, [&](const auto& entry) { return !mine.contains(entry.first); });
    model.load_state_dict(state);
  }
  const std::map<std::string, Tensor> loaded = values_of(model.named_parameters());
  nn::add_lora(model, lora_of<Model>(experts));
  const int pipeline = mesh.shape().pipeline;
  auto wrapper = parallel::data_parallel(
      model, mesh, {.shard = layout.shard, .fsdp = {.reshard_after_forward = pipeline == 1}});
  std::optional<parallel::Pipeline> pipe;
  if (pipeline > 1)
    pipe.emplace(*wrapper, parallel::PipelineOptions{.microbatches = 2, .group = mesh.pipeline()});
  const std::vector<Tensor> trained = wrapper->trained_parameters();
  const std::vector<Tensor> ref_trained = nn::trainable_parameters(reference);
  optim::AdamW opt(trained, kAdamW);
  optim::AdamW ref_opt(ref_trained, kAdamW);
  const int64_t data = mesh.shape().data;
  for (int step = 0; step < 3; ++step) {
    Generator g(uint64_t(50 + step));  // the same batch on every rank
    const Tensor tokens = randint(0, kVocab, {kRows * data, kLength + 1}, {.dtype = kInt64}, &g);
    const Tensor x = tokens.narrow(1, 0, kLength), y = tokens.narrow(1, 1, kLength);
    ref_opt.zero_grad();
    Tensor ref_loss = cross_entropy(reference(x).reshape({-1, kVocab}), y.reshape({-1}));
    ref_loss.backward();
    opt.zero_grad();
    const nn::Inputs in =
        parts.local_inputs(nn::Inputs(x.narrow(0, mesh.data_rank() * kRows, kRows)));
    const Tensor targets = parts.local_sequence(y.narrow(0, mesh.data_rank() * kRows, kRows));
    Tensor loss;
    if (pipe) {
      loss = pipe->train_step(in, targets, [&](const Tensor& logits, const Tensor& target) {
        return parts.cross_entropy(logits, target);
      });
    } else {
      loss = parts.cross_entropy(wrapper->forward(in), targets);
      loss.backward();
    }
    CHECK(parallel::replica_mean(loss, mesh) ==
          doctest::Approx(ref_loss.item<double>()).epsilon(1e-12));
    CHECK(parallel::clip_grad_norm_(trained, kMaxNorm) ==
          doctest::Approx(optim::clip_grad_norm_(ref_trained, kMaxNorm)).epsilon(1e-12));
    ref_opt.step();
    opt.step();
  }
  // Every adapter parameter against its piece of one process's; the base as loaded, no grads.
  std::map<std::string, Tensor> pieces;
  for (const auto& [name, t] : parallel::shard_state_dict(reference.state_dict(), model))
    pieces[name] = t;
  int64_t adapters = 0, frozen = 0;
  for (const auto& [name, t] : wrapper->full_state_dict()) {
    const std::string key = name;
    CAPTURE(key);
    if (name.find("_lora.") != std::string::npos) {
      REQUIRE(pieces.contains(name));
      CHECK(weave_test::close(t, pieces.at(name), 1e-10));
      ++adapters;
    } else if (loaded.contains(name)) {
      CHECK(equal(t, loaded.at(name)));
      ++frozen;
    }
  }
  CHECK(adapters == 2 * int64_t(nn::lora_adapters(model).size()));
  CHECK(adapters >= (pipeline > 1 || experts ? 2 * 4 : 2 * 8));
  CHECK(frozen > 0);
  for (const auto& [name, p] : model.named_parameters()) {
    const std::string key = name;
    CAPTURE(key);
    if (name.find("_lora.") == std::string::npos) CHECK(!p.grad().defined());
  }
}

}  // namespace

TEST_SUITE("lora") {
  TEST_CASE("adapters saved from one layout reload into another and into one process exactly") {
    if (dist::world_size() % 2 != 0) return;
    const std::string kData = std::string(WEAVE_TEST_DATA_DIR) + "/hf/";
    const auto config = data::hf::read_config(kData + "llama");
    const int n = dist::world_size();
    // Saved from tensor parallelism (x data), after a step that moved every adapter.
    parallel::ProcessMesh saving({.data = n / 2, .tensor = 2});
    auto model = models::from_pretrained(kData + "llama", models::ModelSplit::from_mesh(saving));
    const nn::LoRAOptions lora = models::load_adapters(*model, config, kData + "llama_lora");
    {
      auto ddp = parallel::data_parallel(*model, saving);
      optim::AdamW opt(ddp->trained_parameters(), {.lr = 0.01});
      const auto tokens = randint(0, 512, {2, 9}, {.dtype = kInt64});
      const models::ModelSplit parts = models::ModelSplit::from_mesh(saving);
      parts.cross_entropy(ddp->forward(tokens.narrow(1, 0, 8)), tokens.narrow(1, 1, 8)).backward();
      opt.step();
    }
    nn::NamedTensors truth = parallel::gather_state_dict(*model);  // tensor slices, whole
    std::erase_if(truth, [](const auto& e) { return e.first.find("_lora.") == std::string::npos; });
    const std::string dir = test::shared_dir("lora_layouts");
    models::save_adapters(*model, config, lora, dir);
    // Into pipeline stages (x tensor at 4 ranks): each stage's pieces, bit for bit.
    parallel::ProcessMesh loading({.tensor = n / 2, .pipeline = 2});
    auto stage = models::from_pretrained(kData + "llama", models::ModelSplit::from_mesh(loading));
    models::load_adapters(*stage, config, dir);
    std::map<std::string, Tensor> pieces;
    for (const auto& [name, t] : parallel::shard_state_dict(truth, *stage)) pieces[name] = t;
    int64_t compared = 0;
    for (const auto& [name, adapter] : nn::lora_adapters(*stage)) {
      const std::string key = name;
      CAPTURE(key);
      CHECK(equal(adapter->A, pieces.at(name + ".A")));
      CHECK(equal(adapter->B, pieces.at(name + ".B")));
      ++compared;
    }
    CHECK(compared == 7);  // one block's seven projections a stage
    // Into one process: the same logits as the model given the gathered adapters directly.
    auto whole = models::from_pretrained(kData + "llama");
    models::load_adapters(*whole, config, dir);
    auto direct = models::from_pretrained(kData + "llama");
    nn::add_lora(*direct, lora);
    direct->load_state_dict(truth, /*strict=*/false);
    const Tensor tokens = randint(0, 512, {2, 8}, {.dtype = kInt64});
    CHECK(equal((*whole)(tokens), (*direct)(tokens)));
    const Tensor base = (*models::from_pretrained(kData + "llama"))(tokens);
    CHECK(!equal((*whole)(tokens), base));
  }

  TEST_CASE("fully sharded adapters: the frozen base holds no gradient and no optimizer state") {
    manual_seed(21);
    models::Llama model({.vocab = kVocab,
                         .dim = 64,
                         .layers = 2,
                         .block = {.heads = 4, .kv_heads = 2, .hidden = 128}});
    nn::add_lora(model, {.rank = 2, .targets = {"q", "k", "v", "out", "gate", "up", "down"}});
    int64_t adapters = 0, base = 0;
    for (const auto& [name, p] : model.named_parameters())
      (name.find("_lora.") != std::string::npos ? adapters : base) += p.numel();
    parallel::FullyShardedDataParallel fsdp(model, {.group = dist::world()});
    const std::vector<Tensor> shards = fsdp.trained_parameters();
    optim::AdamW opt(shards, kAdamW);
    const Tensor tokens = randint(0, kVocab, {kRows, kLength + 1}, {.dtype = kInt64});
    cross_entropy(fsdp(tokens.narrow(1, 0, kLength)).reshape({-1, kVocab}),
                  tokens.narrow(1, 1, kLength).reshape({-1}))
        .backward();
    opt.step();
    int64_t shard_elements = 0, grad_elements = 0, state_elements = 0;
    for (const Tensor& shard : shards) {
      shard_elements += shard.numel();
      if (shard.grad().defined()) grad_elements += shard.grad().numel();
    }
    for (const auto& [name, p] : model.named_parameters())
      if (p.grad().defined()) grad_elements += p.grad().numel();
    for (const Tensor& t : opt.state()) state_elements += t.numel();
    // This rank's shards of the adapters (with at most one padding element a rank per flat) and
    // nothing of the base's, which is more than ten times larger.
    const int n = dist::world_size();
    CHECK(shard_elements * n >= adapters);
    CHECK(shard_elements * n < adapters + n * int64_t(shards.size() + 2));
    CHECK(grad_elements == shard_elements);
    CHECK(state_elements == 2 * shard_elements);
    CHECK(base > 10 * adapters);
    // The frozen base is sharded too (gathered for compute, never reduced): each rank holds its
    // 1/n of it, in shards that checkpoints and exports read but no optimizer steps.
    int64_t frozen_elements = 0;
    for (const auto& [name, shard] : fsdp.sharded_module().named_parameters()) {
      const std::string parameter = name;  // a lambda cannot capture a binding
      CAPTURE(parameter);
      CHECK(name.ends_with("_frozen") == !shard.requires_grad());
      if (!shard.requires_grad()) frozen_elements += shard.numel();
    }
    CHECK(frozen_elements * n >= base);
    CHECK(frozen_elements * n < base + n * 8);
  }

  TEST_CASE("adapted Llama on every layout equals one process (key/value heads split)") {
    for (const Layout& layout : layouts()) check_layout<models::Llama>(layout, 2);
  }

  TEST_CASE("adapted Llama with one key/value head, replicated over tensor ranks") {
    for (const Layout& layout : layouts()) check_layout<models::Llama>(layout, 1);
  }

  TEST_CASE("adapted attention of a Llama whose experts are spread over the data ranks") {
    for (const Layout& layout : expert_layouts()) check_layout<models::Llama>(layout, -2);
  }

  TEST_CASE("adapted GPT-2 on every layout equals one process") {
    for (const Layout& layout : layouts()) check_layout<models::GPT2>(layout, 0);
  }
}

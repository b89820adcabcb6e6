// parallel::verify_layout: every correct layout of Llama (GQA, experts), GPT-2 and a block of the
// user's own (ring attention) passes against one process in float64 (1e-10), and each seeded
// mistake is named with its seam: a sampler over the wrong group, sequences cut in another
// layout, a loss divided again, an auxiliary loss balanced over one rank's tokens, HSDP without
// its replicate group, clipping over the data group under tensor parallelism, an optimizer that
// loses its parameter groups, a parameter drawn outside DeferredInit, and the three traps of the
// last new-user review (sequence layout, an optimizer over FSDP's released parameters, DDP over
// mesh.data() under context parallelism), which raise in the layout's step and are named too;
// and FSDP's float32 precision policy, which agrees to float32's rounding only.
#include <doctest/doctest.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>

#include "helpers.h"
#include "model_parallel_helpers.h"
#include "weave/weave.h"

using namespace weave;

namespace {

constexpr int64_t kVocab = 40, kDim = 16, kRows = 24, kLength = 8;  // rows divide 1-4 and 8 ranks

template <class Model>
using OptionsOf = std::conditional_t<std::is_same_v<Model, models::Llama>, models::LlamaOptions,
                                     models::GPT2Options>;

models::LlamaOptions llama_options(bool experts = false) {
  const auto moe = experts ? std::optional(nn::MoEOptions{
                                 .hidden = kDim,
                                 .ffn = 16,
                                 .router = {.experts = 4, .top_k = 2, .aux_loss_coef = 0.1}})
                           : std::nullopt;
  return {.vocab = kVocab,
          .dim = kDim,
          .layers = 2,
          .block = {.heads = 2, .kv_heads = 1, .hidden = 32, .moe = moe}};
}

models::GPT2Options gpt2_options() {
  return {.vocab = kVocab, .dim = kDim, .layers = 2, .heads = 2, .max_positions = 16};
}

models::ModelSplit split_of(const parallel::ProcessMesh* mesh, const models::ModelSplit& base) {
  return mesh ? models::ModelSplit::from_mesh(*mesh, base) : models::ModelSplit{};
}

// Rows [d r, (d + 1) r) of `t` for data rank d, r = rows / data ranks.
Tensor data_rows(const Tensor& t, const parallel::ProcessMesh& mesh) {
  const int64_t rows = t.size(0) / mesh.shape().data;
  return t.narrow(0, mesh.data_rank() * rows, rows);
}

// The trainer of a library model, as the walkthrough writes it: the split from the mesh, the
// wrappers from parallel::data_parallel, each rank's rows and sequence part from the split, the
// split's cross-entropy, AdamW over the weight-decay groups (the default), clipping over the
// world (the default).
template <class Model>
parallel::LayoutRecipe lm_recipe(const OptionsOf<Model>& options, bool sharded,
                                 models::ModelSplit base = {}) {
  parallel::LayoutRecipe recipe;
  recipe.model = [options, base](const parallel::ProcessMesh* mesh) {
    return std::static_pointer_cast<nn::Module>(
        std::make_shared<Model>(options, split_of(mesh, base)));
  };
  recipe.wrap = [sharded](nn::Module& part, const parallel::ProcessMesh& mesh) {
    return parallel::data_parallel(
        part, mesh,
        {.shard = sharded, .fsdp = {.reshard_after_forward = mesh.shape().pipeline == 1}});
  };
  recipe.shard = [base](const parallel::LayoutBatch& whole, const parallel::ProcessMesh& mesh) {
    const models::ModelSplit split = split_of(&mesh, base);
    return parallel::LayoutBatch{split.local_inputs(data_rows(whole.inputs.x, mesh)),
                                 split.local_sequence(data_rows(whole.targets, mesh))};
  };
  recipe.loss = [base](const Tensor& logits, const Tensor& targets,
                       const parallel::ProcessMesh* mesh) {
    return split_of(mesh, base).cross_entropy(logits, targets);
  };
  recipe.max_norm = 0.05;  // below the gradients' norm: the step clips
  return recipe;
}

// lm_recipe under ZeRO-1 over `group` (the gradients averaged in its step, a wrap that averages
// nothing), the whole vocabulary on every rank.
parallel::LayoutRecipe zero_recipe(
    std::function<dist::Group(const parallel::ProcessMesh&)> group_of) {
  parallel::LayoutRecipe recipe =
      lm_recipe<models::Llama>(llama_options(), false, {.shard_vocabulary = false});
  recipe.wrap = [](nn::Module& part, const parallel::ProcessMesh& mesh) {
    return parallel::data_parallel(part, mesh, {.optimizer_averages = true});
  };
  recipe.averaging_optimizer = [group_of, max_norm = recipe.max_norm](
                                   nn::Module& part, const parallel::ProcessMesh& mesh) {
    auto zero = std::make_shared<parallel::ZeroRedundancyOptimizer>(
        optim::weight_decay_groups(part, 0.1),
        [](std::vector<optim::ParamGroup> slice) {
          return std::unique_ptr<optim::Optimizer>(
              std::make_unique<optim::AdamW>(slice, optim::AdamWOptions{.lr = 1e-2}));
        },
        group_of(mesh), parallel::ZeroOptions{.max_grad_norm = max_norm});
    return std::function<double()>([zero] {
      zero->step();
      return zero->last_grad_norm();
    });
  };
  return recipe;
}

// lm_recipe under DistributedOptimizer (Horovod's: the gradients averaged, then clipped over the
// world, then AdamW), the whole vocabulary on every rank.
parallel::LayoutRecipe distributed_optimizer_recipe() {
  parallel::LayoutRecipe recipe =
      lm_recipe<models::Llama>(llama_options(), false, {.shard_vocabulary = false});
  recipe.wrap = [](nn::Module& part, const parallel::ProcessMesh& mesh) {
    return parallel::data_parallel(part, mesh, {.optimizer_averages = true});
  };
  recipe.averaging_optimizer = [max_norm = recipe.max_norm](nn::Module& part,
                                                            const parallel::ProcessMesh& mesh) {
    struct Averaging {  // the wrapper goes before the optimizer it refers to
      std::unique_ptr<optim::AdamW> adamw;
      std::unique_ptr<parallel::DistributedOptimizer> averaging;
    };
    auto both = std::make_shared<Averaging>();
    both->adamw = std::make_unique<optim::AdamW>(optim::weight_decay_groups(part, 0.1),
                                                 optim::AdamWOptions{.lr = 1e-2});
    both->averaging = std::make_unique<parallel::DistributedOptimizer>(
        *both->adamw, parallel::DistributedOptimizerOptions{.group = mesh.data_and_context()});
    return std::function<double()>([both, &part, max_norm] {
      both->averaging->average_gradients();
      const double norm = parallel::clip_grad_norm_(part.parameters(), max_norm);
      both->adamw->step();
      return norm;
    });
  };
  return recipe;
}

parallel::LayoutBatch token_batch() {
  Generator g(5);
  const Tensor tokens = randint(0, kVocab, {kRows, kLength + 1}, {.dtype = kInt64}, &g);
  return {.inputs = tokens.narrow(1, 0, kLength).contiguous(),
          .targets = tokens.narrow(1, 1, kLength).contiguous()};
}

// A block of the user's own: causal attention (ring attention over the mesh's context ranks,
// zig-zag, the default) and a residual, each weight drawn by name under DeferredInit, or with
// `eager` one drawn from the global generator at construction.
class RingBlock : public nn::Module {
 public:
  RingBlock(std::optional<dist::Group> context, bool eager) : context_(std::move(context)) {
    for (const char* name : {"wq", "wk", "wv"})
      weights_.push_back(&register_parameter(name, nn::init::normal_parameter({4, 4}, 0, 0.5)));
    weights_.push_back(&register_parameter(
        "wo", eager ? randn({4, 4}) * 0.5 : nn::init::normal_parameter({4, 4}, 0, 0.5)));
  }
  Tensor forward(const Tensor& x) override {  // [B, T, 4]
    const int64_t b = x.size(0), t = x.size(1);
    const Tensor flat = x.reshape({b * t, 4});
    const auto heads = [&](const Tensor& w) {
      return matmul(flat, w).reshape({b, t, 2, 2}).transpose(1, 2);
    };
    const Tensor q = heads(*weights_[0]), k = heads(*weights_[1]), v = heads(*weights_[2]);
    const Tensor a = context_ ? parallel::ring_attention(q, k, v, *context_, {.causal = true})
                              : scaled_dot_product_attention(q, k, v, {.causal = true});
    return (flat + matmul(a.transpose(1, 2).reshape({b * t, 4}), *weights_[3])).reshape({b, t, 4});
  }

 private:
  std::optional<dist::Group> context_;
  std::vector<Tensor*> weights_;  // register_parameter's references follow to() and drawing
};

// The user's block trained on a regression target: each rank's loss the mean over its rows and
// positions, its rows and sequence part cut by shard_sequence in `layout`.
parallel::LayoutRecipe ring_recipe(parallel::SequenceLayout layout, bool eager = false) {
  parallel::LayoutRecipe recipe;
  recipe.model = [eager](const parallel::ProcessMesh* mesh) {
    std::optional<dist::Group> context;
    if (mesh && mesh->shape().context > 1) context = mesh->context();
    return std::static_pointer_cast<nn::Module>(std::make_shared<RingBlock>(context, eager));
  };
  recipe.shard = [layout](const parallel::LayoutBatch& whole, const parallel::ProcessMesh& mesh) {
    const auto cut = [&](const Tensor& t) {
      return parallel::shard_sequence(data_rows(t, mesh), 1, mesh.context(), layout);
    };
    return parallel::LayoutBatch{cut(whole.inputs.x), cut(whole.targets)};
  };
  recipe.loss = [](const Tensor& y, const Tensor& target, const parallel::ProcessMesh*) {
    return ((y - target) * (y - target)).mean();
  };
  recipe.max_norm = 0.05;
  return recipe;
}

parallel::LayoutBatch float_batch() {
  return {.inputs = weave_test::shared_randn({kRows, kLength, 4}, 11),
          .targets = weave_test::shared_randn({kRows, kLength, 4}, 12)};
}

void check_passes(const parallel::MeshShape& shape, const parallel::LayoutRecipe& recipe,
                  const parallel::LayoutBatch& batch, const char* what) {
  CAPTURE(what);
  CAPTURE(shape.data);
  CAPTURE(shape.tensor);
  CAPTURE(shape.context);
  CAPTURE(shape.pipeline);
  CAPTURE(shape.expert);
  CAPTURE(shape.replicate);
  const parallel::ProcessMesh mesh(shape);
  const parallel::LayoutReport report = parallel::verify_layout(mesh, recipe, batch);
  const std::string text = report.str();
  CAPTURE(text);
  CHECK(report.passed);
  CHECK(report.largest_difference < 1e-10);
  CHECK(report.compared >= 3 * 4);
}

parallel::LayoutReport verify(const parallel::MeshShape& shape,
                              const parallel::LayoutRecipe& recipe,
                              const parallel::LayoutBatch& batch) {
  const parallel::ProcessMesh mesh(shape);
  return parallel::verify_layout(mesh, recipe, batch);
}

// The report names `seam`, and the first divergence starts with `diverged`.
void check_names(const parallel::LayoutReport& report, const std::string& seam,
                 const std::string& diverged) {
  const std::string text = report.str();
  CAPTURE(text);
  CHECK_FALSE(report.passed);
  CHECK(report.seam == seam);
  CHECK(report.diverged.starts_with(diverged));
  CHECK_FALSE(report.detail.empty());
}

}  // namespace

TEST_SUITE("verify_layout") {
  TEST_CASE("every correct layout passes against one process (1e-10)") {
    const int n = dist::world_size();
    const auto llama = [&](parallel::MeshShape shape, bool sharded, models::ModelSplit base = {}) {
      check_passes(shape, lm_recipe<models::Llama>(llama_options(), sharded, base), token_batch(),
                   "llama");
    };
    const auto gpt2 = [&](parallel::MeshShape shape, bool sharded, models::ModelSplit base = {}) {
      check_passes(shape, lm_recipe<models::GPT2>(gpt2_options(), sharded, base), token_batch(),
                   "gpt2");
    };
    llama({.data = n}, false);
    llama({.data = n}, true);
    gpt2({.data = n}, true);
    check_passes({.data = n}, ring_recipe(parallel::SequenceLayout::ZigZag), float_batch(),
                 "own block");
    if (n == 2) {
      llama({.tensor = 2}, false);
      gpt2({.tensor = 2}, false, {.sequence_parallel = true});
      llama({.context = 2}, false);
      llama({.pipeline = 2}, true);
      gpt2({.pipeline = 2}, false);
      gpt2({.tensor = 2}, false);
    }
    if (n == 4) {
      llama({.data = 2, .tensor = 2}, true);
      llama({.data = 2, .context = 2}, false);
      llama({.data = 4, .replicate = 2}, true);
      llama({.data = 2, .pipeline = 2}, true);
      llama({.tensor = 2, .pipeline = 2}, false);
      llama({.tensor = 2, .context = 2}, false);
      gpt2({.data = 2, .pipeline = 2}, true);
      gpt2({.data = 2, .tensor = 2}, false);
    }
    if (n == 8) {  // every axis at once
      llama({.data = 2, .tensor = 2, .context = 2}, false);
      llama({.data = 2, .tensor = 2, .pipeline = 2}, true);
      llama({.data = 4, .tensor = 2, .replicate = 2}, true);
      gpt2({.data = 2, .tensor = 2, .pipeline = 2}, true);
      check_passes({.data = 2, .tensor = 2, .context = 2, .expert = 4},
                   lm_recipe<models::Llama>(llama_options(true), true), token_batch(),
                   "llama with experts, every axis");
    }
    {  // low-rank adapters on a frozen base: only they train, in any layout
      const auto with_adapters = [](parallel::LayoutRecipe recipe) {
        recipe.model = [inner = recipe.model](const parallel::ProcessMesh* mesh) {
          std::shared_ptr<nn::Module> model = inner(mesh);
          nn::add_lora(*model, {.rank = 4, .alpha = 8});
          return model;
        };
        return recipe;
      };
      check_passes({.data = n}, with_adapters(lm_recipe<models::Llama>(llama_options(), true)),
                   token_batch(), "llama with adapters, fsdp");
      if (n % 2 == 0)
        check_passes({.data = n / 2, .tensor = 2},
                     with_adapters(lm_recipe<models::Llama>(llama_options(), false)), token_batch(),
                     "llama with adapters, tensor parallel");
    }
    check_passes({.data = n},
                 zero_recipe([](const parallel::ProcessMesh& m) { return m.data_and_context(); }),
                 token_batch(), "llama under ZeRO-1");
    check_passes({.data = n}, distributed_optimizer_recipe(), token_batch(),
                 "llama under DistributedOptimizer");
    if (n % 2 == 0)
      check_passes({.data = n / 2, .context = 2}, ring_recipe(parallel::SequenceLayout::ZigZag),
                   float_batch(), "own block, context parallel");
    if (n == 2 || n == 4)
      check_passes({.data = n, .expert = 2}, lm_recipe<models::Llama>(llama_options(true), false),
                   token_batch(), "llama with experts");
  }

  TEST_CASE(
      "sampler group: tensor peers reading other rows, or shares that cover the batch twice") {
    const int n = dist::world_size();
    if (n % 2 != 0) return;
    // Rows by world rank: the two ranks of a tensor group read different rows.
    parallel::LayoutRecipe by_world_rank = lm_recipe<models::Llama>(llama_options(), false);
    by_world_rank.shard = [](const parallel::LayoutBatch& whole, const parallel::ProcessMesh&) {
      const int64_t rows = kRows / dist::world_size();
      return parallel::LayoutBatch{whole.inputs.x.narrow(0, dist::rank() * rows, rows),
                                   whole.targets.narrow(0, dist::rank() * rows, rows)};
    };
    const parallel::LayoutReport peers =
        verify({.data = n / 2, .tensor = 2}, by_world_rank, token_batch());
    check_names(peers, "sampler group", "the inputs");
    CHECK(peers.detail.find("tensor or pipeline peers") != std::string::npos);
    // Every data rank reads the whole batch: the numbers agree, the coverage does not.
    parallel::LayoutRecipe unsharded = lm_recipe<models::Llama>(llama_options(), false);
    unsharded.shard = [](const parallel::LayoutBatch& whole, const parallel::ProcessMesh&) {
      return whole;
    };
    const parallel::LayoutReport twice = verify({.data = n}, unsharded, token_batch());
    check_names(twice, "sampler group", "the inputs");
    CHECK(twice.detail.find("exactly once") != std::string::npos);
  }

  TEST_CASE("sequence layout: the user's block reads zig-zag parts, the sampler cut contiguous") {
    const int n = dist::world_size();
    if (n % 2 != 0) return;
    check_names(verify({.data = n / 2, .context = 2},
                       ring_recipe(parallel::SequenceLayout::Contiguous), float_batch()),
                "sequence layout", "the loss");
  }

  TEST_CASE("trap 1: a library model's parts cut in the other layout raise, named as the layout") {
    const int n = dist::world_size();
    if (n % 2 != 0) return;
    parallel::LayoutRecipe recipe = lm_recipe<models::Llama>(llama_options(), false);
    recipe.shard = [](const parallel::LayoutBatch& whole, const parallel::ProcessMesh& mesh) {
      const auto cut = [&](const Tensor& t) {
        return parallel::shard_sequence(data_rows(t, mesh), 1, mesh.context(),
                                        parallel::SequenceLayout::Contiguous);
      };
      return parallel::LayoutBatch{cut(whole.inputs.x), cut(whole.targets)};
    };
    const parallel::LayoutReport report =
        verify({.data = n / 2, .context = 2}, recipe, token_batch());
    check_names(report, "sequence layout", "the forward (raised)");
  }

  TEST_CASE("loss normalization: a loss divided by the data ranks the wrapper already averages") {
    const int n = dist::world_size();
    if (n < 2) return;
    parallel::LayoutRecipe recipe = lm_recipe<models::Llama>(llama_options(), true);
    const auto mean = recipe.loss;
    recipe.loss = [mean](const Tensor& logits, const Tensor& targets,
                         const parallel::ProcessMesh* mesh) {
      const Tensor loss = mean(logits, targets, mesh);
      return mesh ? loss / double(mesh->data().size()) : loss;
    };
    const parallel::LayoutReport report = verify({.data = n}, recipe, token_batch());
    check_names(report, "loss normalization", "the loss");
    CHECK(report.detail.find(fmt::format("{:.6g} x", 1.0 / n)) != std::string::npos);
  }

  TEST_CASE("auxiliary loss: experts spread without a balance group count one rank's tokens") {
    const int n = dist::world_size();
    if (n != 2 && n != 4) return;
    parallel::LayoutRecipe recipe =
        lm_recipe<models::Llama>(llama_options(true), false, {.shard_vocabulary = false});
    recipe.model = [](const parallel::ProcessMesh* mesh) {
      models::ModelSplit split;
      if (mesh) split.expert_group = mesh->expert();  // no balance_group
      return std::static_pointer_cast<nn::Module>(
          std::make_shared<models::Llama>(llama_options(true), split));
    };
    const parallel::LayoutReport report = verify({.data = n, .expert = 2}, recipe, token_batch());
    check_names(report, "auxiliary loss", "the gradient of ");
    CHECK(report.detail.find("routers' gradients differ") != std::string::npos);
  }

  TEST_CASE("replicate group: HSDP whose shards are never averaged over the replicas") {
    const int n = dist::world_size();
    if (n != 2 && n != 4) return;
    parallel::LayoutRecipe recipe = lm_recipe<models::Llama>(llama_options(), true);
    recipe.wrap = [](nn::Module& part, const parallel::ProcessMesh& mesh) {
      return std::unique_ptr<parallel::DataParallelWrapper>(
          std::make_unique<parallel::FullyShardedDataParallel>(
              part, parallel::FSDPOptions{.group = mesh.shard()}));  // no replicate_group
    };
    const parallel::LayoutReport report =
        verify({.data = n, .replicate = 2}, recipe, token_batch());
    check_names(report, "replicate group", "the gradient of ");
    CHECK(report.detail.find("hold different gradients") != std::string::npos);
  }

  TEST_CASE("replicate group: ZeRO-1 averaging over each rank alone") {
    const int n = dist::world_size();
    if (n < 2) return;
    const parallel::LayoutReport report =
        verify({.data = n}, zero_recipe([](const parallel::ProcessMesh& m) { return m.tensor(); }),
               token_batch());
    check_names(report, "replicate group", "the norm");
    CHECK(report.detail.find("optimizer's own step") != std::string::npos);
  }

  TEST_CASE("trap 3: DDP over mesh.data() under context parallelism raises, named as the group") {
    const int n = dist::world_size();
    if (n % 2 != 0) return;
    parallel::LayoutRecipe recipe = lm_recipe<models::Llama>(llama_options(), false);
    recipe.wrap = [](nn::Module& part, const parallel::ProcessMesh& mesh) {
      return std::unique_ptr<parallel::DataParallelWrapper>(
          std::make_unique<parallel::DistributedDataParallel>(
              part, parallel::DDPOptions{.group = mesh.data()}));
    };
    const parallel::LayoutReport report =
        verify({.data = n / 2, .context = 2}, recipe, token_batch());
    check_names(report, "replicate group", "the wrapper (raised)");
    CHECK(report.detail.find("data_and_context") != std::string::npos);
  }

  TEST_CASE("clip group: clipping over the data group under tensor parallelism") {
    const int n = dist::world_size();
    if (n % 2 != 0) return;
    parallel::LayoutRecipe recipe =
        lm_recipe<models::Llama>(llama_options(), false, {.shard_vocabulary = false});
    const parallel::ProcessMesh* shared = nullptr;
    recipe.clip = [&shared](const std::vector<Tensor>& params, double max_norm) {
      return parallel::clip_grad_norm_(params, max_norm, 2.0, shared->data());
    };
    const parallel::ProcessMesh mesh({.data = n / 2, .tensor = 2});
    shared = &mesh;
    // Over 2 ranks the data group cannot hold the model's 2 slices (it raises); over 4 it holds
    // one slice twice (a wrong norm).
    const parallel::LayoutReport report = parallel::verify_layout(mesh, recipe, token_batch());
    check_names(report, "clip group", n == 2 ? "the clip (raised)" : "the norm");
  }

  TEST_CASE("optimizer: the layout's optimizer loses the weight-decay groups one process keeps") {
    const int n = dist::world_size();
    parallel::LayoutRecipe recipe = lm_recipe<models::Llama>(llama_options(), true);
    recipe.optimizer = [](nn::Module& model, parallel::DataParallelWrapper* wrapper) {
      return std::unique_ptr<optim::Optimizer>(
          wrapper
              ? std::make_unique<optim::AdamW>(wrapper->trained_parameters(),
                                               optim::AdamWOptions{.lr = 1e-2, .weight_decay = 0.1})
              : std::make_unique<optim::AdamW>(optim::weight_decay_groups(model, 0.1),
                                               optim::AdamWOptions{.lr = 1e-2}));
    };
    check_names(verify({.data = n}, recipe, token_batch()), "optimizer", "the parameter ");
  }

  TEST_CASE("trap 2: an optimizer over the model's own parameters under FSDP raises, named") {
    const int n = dist::world_size();
    parallel::LayoutRecipe recipe = lm_recipe<models::Llama>(llama_options(), true);
    recipe.optimizer = [](nn::Module& model, parallel::DataParallelWrapper*) {
      return std::unique_ptr<optim::Optimizer>(std::make_unique<optim::AdamW>(
          optim::weight_decay_groups(model, 0.1), optim::AdamWOptions{.lr = 1e-2}));
    };
    const parallel::LayoutReport report = verify({.data = n}, recipe, token_batch());
    check_names(report, "optimizer", "the optimizer step (raised)");
    CHECK(report.detail.find("param_groups") != std::string::npos);
  }

  TEST_CASE("initialization: a weight drawn from the global generator at construction") {
    const int n = dist::world_size();
    check_names(
        verify({.data = n}, ring_recipe(parallel::SequenceLayout::ZigZag, true), float_batch()),
        "initialization", "the parameter wo before the step");
  }

  TEST_CASE("precision: FSDP reducing and returning float32 agrees to float32's rounding only") {
    const int n = dist::world_size();
    parallel::LayoutRecipe recipe = lm_recipe<models::Llama>(llama_options(), true);
    recipe.wrap = [](nn::Module& part, const parallel::ProcessMesh& mesh) {
      return parallel::data_parallel(
          part, mesh,
          {.shard = true, .fsdp = {.reduce_dtype = kFloat32, .output_dtype = kFloat32}});
    };
    const parallel::LayoutReport report = verify({.data = n}, recipe, token_batch());
    check_names(report, "precision", "the ");
    CHECK(report.difference > 1e-10);
    CHECK(report.difference < 1e-5);
  }

  TEST_CASE("a recipe without a model raises on every rank") {
    const parallel::ProcessMesh mesh({.data = dist::world_size()});
    CHECK_THROWS_WITH_AS(parallel::verify_layout(mesh, {}, token_batch()),
                         doctest::Contains("the recipe has no model"), Error);
  }
}

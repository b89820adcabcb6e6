// The vocabulary split over the ranks that read different batches (ModelSplit::vocabulary, set by
// from_mesh): Llama and GPT-2 under FSDP (plain, HSDP, with tensor parallelism, in two pipeline
// stages) and under DDP, tied and untied, equal one process on the stacked batch in float64
// (losses, gradient norms, parameters after 3 AdamW steps), FSDP never gathers the pieces, and
// their sharded checkpoints load at other layouts. Independent truth: the whole model trained on
// every rank's rows at once.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <type_traits>

#include "helpers.h"
#include "model_parallel_helpers.h"

using namespace weave;

namespace {

constexpr int64_t kVocab = 37, kDim = 16, kRows = 2, kLength = 5;
constexpr double kMaxNorm = 0.05;
constexpr optim::AdamWOptions kAdamW{.lr = 0.02, .weight_decay = 0.01};

template <class Model>
using OptionsOf = std::conditional_t<std::is_same_v<Model, models::Llama>, models::LlamaOptions,
                                     models::GPT2Options>;

// 37 tokens: padded among 2, 3 or 4 pieces.
template <class Model>
OptionsOf<Model> options_of(bool tied) {
  if constexpr (std::is_same_v<Model, models::Llama>)
    return {.vocab = kVocab,
            .dim = kDim,
            .layers = 2,
            .block = {.heads = 2, .kv_heads = 1, .hidden = 32},
            .tie_embeddings = tied};
  else
    return {.vocab = kVocab,
            .dim = kDim,
            .layers = 2,
            .heads = 2,
            .max_positions = 16,
            .untied_head = !tied,
            .head_bias = !tied};
}

// This rank's pieces of `whole`'s values, under its own names (its stage's).
void load_pieces(nn::Module& part, nn::Module& whole) {
  nn::NamedTensors state = parallel::shard_state_dict(whole.state_dict(), part);
  const auto names = part.state_dict();
  std::erase_if(state, [&](const auto& entry) {
    return std::none_of(names.begin(), names.end(),
                        [&](const auto& mine) { return mine.first == entry.first; });
  });
  part.load_state_dict(state);
}

// Every rank's tokens of a step: rows [d kRows, (d + 1) kRows) are data rank d's.
Tensor tokens_of(int step, int data) {
  Generator g(uint64_t(50 + step));
  return randint(0, kVocab, {kRows * data, kLength + 1}, {.dtype = kInt64}, &g);
}

Tensor whole_loss(nn::Module& model, const Tensor& x, const Tensor& y) {
  const Tensor logits = model(x);
  return cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
}

// Checks every parameter `held` (by name) against `reference`'s piece of it.
void check_pieces(const nn::NamedTensors& held, nn::Module& part, nn::Module& reference) {
  std::map<std::string, Tensor> pieces;
  for (const auto& [name, t] : parallel::shard_state_dict(reference.state_dict(), part))
    pieces[name] = t;
  int64_t compared = 0, vocabulary = 0;
  for (const auto& [name, t] : held) {
    const std::string key = name;  // a lambda cannot capture a binding
    CAPTURE(key);
    REQUIRE(pieces.contains(key));
    CHECK(weave_test::close(t, pieces.at(key), 1e-10));
    ++compared;
    vocabulary +=
        key.starts_with("embedding.") || key.starts_with("tokens.") || key.starts_with("head.");
  }
  CHECK(compared >= 4);
  CHECK(vocabulary >= 1);
}

// The model split as `shape` says (vocabulary over the shard group), under FSDP (or DDP) and in
// two pipeline stages when shape.pipeline is 2, against the whole model on every rank's rows.
template <class Model>
void check_against_one_process(const parallel::MeshShape& shape, bool tied, bool sharded) {
  CAPTURE(shape.data);
  CAPTURE(shape.tensor);
  CAPTURE(shape.pipeline);
  CAPTURE(shape.replicate);
  CAPTURE(tied);
  CAPTURE(sharded);
  const OptionsOf<Model> options = options_of<Model>(tied);
  manual_seed(17);
  Model reference(options);
  reference.to(kFloat64);
  parallel::ProcessMesh mesh(shape);
  const models::ModelSplit split = models::ModelSplit::from_mesh(mesh);
  REQUIRE(split.vocabulary.has_value());
  Model part(options, split);
  part.to(kFloat64);
  load_pieces(part, reference);
  auto wrapper = parallel::data_parallel(
      part, mesh, {.shard = sharded, .fsdp = {.reshard_after_forward = shape.pipeline == 1}});
  std::unique_ptr<parallel::Pipeline> pipe;
  if (shape.pipeline > 1)
    pipe = std::make_unique<parallel::Pipeline>(
        *wrapper, parallel::PipelineOptions{.microbatches = 2, .group = mesh.pipeline()});
  const std::vector<Tensor> trained = wrapper->trained_parameters();
  optim::AdamW opt(trained, kAdamW);
  optim::AdamW ref_opt(reference.parameters(), kAdamW);
  const auto objective = [&](const Tensor& logits, const Tensor& targets) {
    return split.cross_entropy(logits, targets);
  };
  for (int step = 0; step < 3; ++step) {
    const Tensor tokens = tokens_of(step, shape.data);
    const Tensor x = tokens.narrow(1, 0, kLength), y = tokens.narrow(1, 1, kLength);
    ref_opt.zero_grad();
    Tensor ref_loss = whole_loss(reference, x, y);
    ref_loss.backward();
    opt.zero_grad();
    const Tensor mine_x = x.narrow(0, mesh.data_rank() * kRows, kRows);
    const Tensor mine_y = y.narrow(0, mesh.data_rank() * kRows, kRows);
    Tensor loss;
    if (pipe) {
      loss = pipe->train_step(mine_x, mine_y, objective);
    } else {
      loss = objective(wrapper->forward(mine_x), mine_y);
      loss.backward();
    }
    CHECK(parallel::replica_mean(loss, mesh) ==
          doctest::Approx(ref_loss.item<double>()).epsilon(1e-12));
    CHECK(parallel::clip_grad_norm_(trained, kMaxNorm) ==
          doctest::Approx(optim::clip_grad_norm_(reference.parameters(), kMaxNorm)).epsilon(1e-12));
    ref_opt.step();
    opt.step();
  }
  check_pieces(wrapper->full_state_dict(), part, reference);
  // The copies of every piece agree, and pieces that differ (vocabulary pieces, tensor-parallel
  // members of a flat shard) are told apart, not taken for copies.
  CHECK_NOTHROW(parallel::check_replicas(wrapper->sharded_module()));
  {  // evaluation: a pipeline's predict joins the micro-batches as one forward gives them
    NoGradGuard no_grad;
    const Tensor tokens = tokens_of(3, shape.data);
    const Tensor x = tokens.narrow(1, 0, kLength), y = tokens.narrow(1, 1, kLength);
    const Tensor reference_loss = whole_loss(reference, x, y);
    const double expected = reference_loss.item<double>();
    const Tensor mine_x = x.narrow(0, mesh.data_rank() * kRows, kRows);
    const Tensor logits = pipe ? pipe->predict(mine_x) : wrapper->forward(mine_x);
    const Tensor loss = logits.defined()
                            ? objective(logits, y.narrow(0, mesh.data_rank() * kRows, kRows))
                            : Tensor();
    CHECK(parallel::replica_mean(loss, mesh) == doctest::Approx(expected).epsilon(1e-12));
  }
}

// One AdamW step of `model` (a wrapper's forward, or the whole model's on every row) on step
// `step`'s batch; the whole model's loss.
void train_step(const std::function<Tensor(const Tensor&, const Tensor&)>& loss_of,
                optim::Optimizer& opt, int step) {
  const Tensor tokens = tokens_of(step, dist::world_size());
  opt.zero_grad();
  loss_of(tokens.narrow(1, 0, kLength), tokens.narrow(1, 1, kLength)).backward();
  opt.step();
}

// Trained 2 steps under FSDP with the vocabulary split (tied or not), saved sharded, then
// loaded on every rank into the whole model and into FSDP without the vocabulary split: the
// parameters equal one process's after those steps, and one more step (moments and step count
// loaded too) equals its third.
void check_checkpoint_across_layouts(bool tied) {
  CAPTURE(tied);
  const int n = dist::world_size();
  const models::LlamaOptions options = options_of<models::Llama>(tied);
  manual_seed(17);
  models::Llama reference(options);
  reference.to(kFloat64);
  optim::AdamW ref_opt(reference.parameters(), kAdamW);
  const auto whole_loss_of = [](nn::Module& model) {
    return [&model](const Tensor& x, const Tensor& y) { return whole_loss(model, x, y); };
  };
  parallel::ProcessMesh mesh({.data = n});
  const auto rows = [&](const Tensor& t) { return t.narrow(0, mesh.data_rank() * kRows, kRows); };
  const std::string dir = test::shared_dir(tied ? "vocabulary_tied" : "vocabulary");
  {
    const models::ModelSplit split = models::ModelSplit::from_mesh(mesh);
    models::Llama part(options, split);
    part.to(kFloat64);
    load_pieces(part, reference);
    auto fsdp = parallel::data_parallel(part, mesh, {.shard = true});
    optim::AdamW opt(fsdp->trained_parameters(), kAdamW);
    for (int step = 0; step < 2; ++step) {
      train_step(whole_loss_of(reference), ref_opt, step);
      train_step(
          [&](const Tensor& x, const Tensor& y) {
            return split.cross_entropy(fsdp->forward(rows(x)), rows(y));
          },
          opt, step);
    }
    parallel::save_sharded_checkpoint(dir, {.model = &fsdp->sharded_module(), .optimizer = &opt});
  }
  train_step(whole_loss_of(reference), ref_opt, 2);
  {                   // the whole model on every rank
    manual_seed(99);  // other draws: the checkpoint must replace them all
    models::Llama whole(options);
    whole.to(kFloat64);
    optim::AdamW opt(whole.parameters(), kAdamW);
    data::TrainingState state{.model = &whole, .optimizer = &opt};
    parallel::load_sharded_checkpoint(dir, state);
    train_step(whole_loss_of(whole), opt, 2);
    check_pieces(whole.named_parameters(), whole, reference);
  }
  {  // FSDP gathering the embedding and the head as units
    const models::ModelSplit split =
        models::ModelSplit::from_mesh(mesh, {.shard_vocabulary = false});
    REQUIRE_FALSE(split.vocabulary.has_value());
    manual_seed(99);
    models::Llama part(options, split);
    part.to(kFloat64);
    auto fsdp = parallel::data_parallel(part, mesh, {.shard = true});
    optim::AdamW opt(fsdp->trained_parameters(), kAdamW);
    data::TrainingState state{.model = &fsdp->sharded_module(), .optimizer = &opt};
    parallel::load_sharded_checkpoint(dir, state);
    train_step(
        [&](const Tensor& x, const Tensor& y) {
          return split.cross_entropy(fsdp->forward(rows(x)), rows(y));
        },
        opt, 2);
    check_pieces(fsdp->full_state_dict(), part, reference);
  }
}

}  // namespace

TEST_SUITE("vocabulary") {
  TEST_CASE("FSDP with the vocabulary over its shard group equals one process: Llama, GPT-2") {
    const int n = dist::world_size();
    if (n < 2) return;
    for (const bool tied : {false, true}) {
      check_against_one_process<models::Llama>({.data = n}, tied, true);
      check_against_one_process<models::GPT2>({.data = n}, tied, true);
    }
  }

  TEST_CASE("DDP with the vocabulary over its data group equals one process") {
    const int n = dist::world_size();
    if (n < 2) return;
    check_against_one_process<models::Llama>({.data = n}, false, false);
    check_against_one_process<models::GPT2>({.data = n}, true, false);
  }

  TEST_CASE("tensor x FSDP, two pipeline stages x FSDP, HSDP: the vocabulary equals one process") {
    if (dist::world_size() != 4) return;
    for (const bool tied : {false, true}) {
      check_against_one_process<models::Llama>({.data = 2, .tensor = 2}, tied, true);
      check_against_one_process<models::Llama>({.data = 2, .pipeline = 2}, tied, true);
      check_against_one_process<models::GPT2>({.data = 2, .pipeline = 2}, tied, true);
    }
    check_against_one_process<models::Llama>({.data = 4, .replicate = 2}, false, true);
  }
}

TEST_SUITE("vocabulary") {
  TEST_CASE("sharded checkpoints of vocabulary pieces load whole, and under FSDP without them") {
    if (dist::world_size() < 2) return;
    check_checkpoint_across_layouts(false);
    check_checkpoint_across_layouts(true);
  }

  TEST_CASE("ranks passing batches of different shapes raise on every rank, naming them") {
    const int n = dist::world_size();
    if (n < 2) return;
    parallel::ProcessMesh mesh({.data = n});
    manual_seed(17);
    models::Llama part(options_of<models::Llama>(false), models::ModelSplit::from_mesh(mesh));
    const Tensor x = zeros({1 + dist::rank() % 2, kLength}, {.dtype = kInt64});
    CHECK_THROWS_WITH_AS(part(x), doctest::Contains("pass rows of different shapes"), Error);
    // Every rank can go on: the same shapes pass; targets of another length on one rank
    // raise on every rank too.
    const models::ModelSplit split = models::ModelSplit::from_mesh(mesh);
    const Tensor logits = part(zeros({1, kLength}, {.dtype = kInt64}));
    CHECK(logits.size(0) == n);
    const Tensor targets = zeros({1, kLength - dist::rank() % 2}, {.dtype = kInt64});
    CHECK_THROWS_WITH_AS(split.cross_entropy(logits, targets),
                         doctest::Contains("pass rows of different shapes"), Error);
    CHECK(split.cross_entropy(logits, zeros({1, kLength}, {.dtype = kInt64})).dim() == 0);
  }
}

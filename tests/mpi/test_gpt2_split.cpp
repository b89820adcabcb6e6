// models::GPT2 with the original GPT's options (the exact GELU, a head of its own with a bias)
// split over a tensor group, with and without sequence parallelism, against the same model on
// one rank drawn from the same seed: the loss (ModelSplit::cross_entropy), the gathered logits
// and every gradient, float64 to 1e-12 relative, with a vocabulary the ranks pad. The splits
// that cannot be built or decode raise on every rank.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <string>

#include "model_parallel_helpers.h"
#include "weave/weave.h"

using namespace weave;
using namespace weave_test;

namespace {

constexpr int64_t kVocab = 13;  // padded to 14 at 2 ranks, 15 at 3, 16 at 4

models::GPT2Options original_gpt() {
  return {.vocab = kVocab,
          .dim = 24,
          .layers = 2,
          .heads = 12,
          .max_positions = 16,
          .tanh_gelu = false,
          .untied_head = true,
          .head_bias = true};
}

// Drawn by parameter name (nn::DeferredInit): every split holds the slices of one whole model,
// a padded vocabulary's rows included.
std::shared_ptr<models::GPT2> build(models::ModelSplit split) {
  std::shared_ptr<models::GPT2> model;
  {
    nn::DeferredInit deferred(47);
    model = std::make_shared<models::GPT2>(original_gpt(), std::move(split));
  }
  model->to(kFloat64);
  nn::materialize(*model);
  return model;
}

// The whole model's gradient of `name` as the split's rank holds it: its piece along the cut,
// vocabulary rows padded first.
Tensor expected_piece(const Tensor& whole, const std::string& name,
                      const std::map<std::string, parallel::TensorSplit>& splits,
                      const dist::Group& tp) {
  const auto cut = splits.find(name);
  if (cut == splits.end()) return whole;
  const bool vocabulary = name.starts_with("tokens.") || name.starts_with("head.");
  const Tensor padded =
      vocabulary ? parallel::pad_rows(whole, parallel::padded_vocab(kVocab, tp.size())) : whole;
  return piece(padded, cut->second.axis, tp);
}

}  // namespace

TEST_SUITE("model_parallel") {
  TEST_CASE(
      "GPT2 with an untied biased head and the exact GELU, split with and without "
      "sequence parallelism, equals the model on one rank") {
    const dist::Group tp = dist::world();
    std::vector<std::vector<int>> singletons;
    for (int r = 0; r < tp.size(); ++r) singletons.push_back({r});
    const dist::Group alone = dist::split_group(dist::world(), singletons);
    Generator g(9);
    const Tensor tokens = randint(0, kVocab, {2, 12}, {.dtype = kInt64}, &g);  // 12: 1-4 divide
    const Tensor targets = randint(0, kVocab, {2, 12}, {.dtype = kInt64}, &g);
    const models::ModelSplit one_rank{.tensor = alone};
    auto whole = build(one_rank);
    const Tensor whole_loss = one_rank.cross_entropy((*whole)(tokens), targets);
    whole_loss.backward();
    // The nn/ layers (no tensor group) hold the same model: the same logits from its weights.
    auto plain = build({});
    plain->load_state_dict(whole->state_dict());
    {
      NoGradGuard no_grad;
      CHECK(close(one_rank.cross_entropy((*plain)(tokens), targets), whole_loss, 1e-12));
    }
    for (const bool sequence_parallel : {false, true}) {
      CAPTURE(sequence_parallel);
      const models::ModelSplit split{.tensor = tp, .sequence_parallel = sequence_parallel};
      auto mine = build(split);
      const Tensor loss = split.cross_entropy((*mine)(tokens), targets);
      CHECK(close(loss, whole_loss, 1e-12));
      loss.backward();
      const auto splits = parallel::tensor_splits(*mine);
      const auto compared = check_split_grads(
          *mine, *whole,
          [&](const std::string& name, const Tensor& want) {
            return expected_piece(want, name, splits, tp);
          },
          1e-12);
      CHECK(compared.size() == whole->named_parameters().size());
      // Gathered, every rank holds the whole model's logits.
      models::ModelSplit gathered = split;
      gathered.gather_logits = true;
      auto full = build(gathered);
      full->load_state_dict(mine->state_dict());
      NoGradGuard no_grad;
      CHECK(close((*full)(tokens), (*plain)(tokens), 1e-12));
    }
  }

  TEST_CASE("sequence parallelism: the splits it cannot take raise on every rank") {
    const dist::Group tp = dist::world();
    CHECK_THROWS_WITH_AS(build({.sequence_parallel = true}),
                         doctest::Contains("sequence parallelism splits the sequence over a "
                                           "tensor group"),
                         Error);
    models::GPT2Options with_experts = original_gpt();
    with_experts.moe = nn::MoEOptions{.hidden = 24, .ffn = 16};
    CHECK_THROWS_WITH_AS(models::GPT2(with_experts, {.tensor = tp, .sequence_parallel = true}),
                         doctest::Contains("experts: true"), Error);
    CHECK_THROWS_WITH_AS(
        models::Llama({.vocab = 12, .dim = 24, .layers = 1, .block = {.heads = 12}},
                      {.tensor = tp, .sequence_parallel = true}),
        doctest::Contains("Llama's tensor-parallel layers take whole sequences"), Error);
    auto model = build({.tensor = tp, .sequence_parallel = true});
    auto caches = model->make_caches(8);
    CHECK_THROWS_WITH_AS(model->forward_cached(from_vector<int64_t>({1, 2}, {1, 2}), caches),
                         doctest::Contains("not split along the sequence"), Error);
  }

  TEST_CASE("GPT2 and Llama over a context group, without a tensor group, equal one process") {
    const int n = dist::world_size();
    const parallel::ProcessMesh mesh({.context = n});
    const int64_t t = 2 * n * (16 / (2 * n));  // divides into 2n zig-zag chunks, <= 16 positions
    Generator g(19);
    const Tensor tokens = randint(0, kVocab, {2, t}, {.dtype = kInt64}, &g);
    const Tensor targets = randint(0, kVocab, {2, t}, {.dtype = kInt64}, &g);
    for (const std::string arch : {"gpt2", "llama"}) {
      CAPTURE(arch);
      auto make = [&](const models::ModelSplit& split) -> std::shared_ptr<nn::CausalLM> {
        std::shared_ptr<nn::CausalLM> model;
        {
          nn::DeferredInit deferred(48);
          if (arch == "gpt2")
            model = std::make_shared<models::GPT2>(original_gpt(), split);
          else
            model = std::make_shared<models::Llama>(
                models::LlamaOptions{.vocab = kVocab,
                                     .dim = 24,
                                     .layers = 2,
                                     .block = {.heads = 4, .kv_heads = 2, .hidden = 32}},
                split);
        }
        model->to(kFloat64);
        nn::materialize(*model);
        return model;
      };
      auto whole = make({});
      const Tensor whole_loss =
          cross_entropy((*whole)(tokens).reshape({-1, kVocab}), targets.reshape({-1}));
      whole_loss.backward();
      const models::ModelSplit split{.context_group = mesh.context()};
      CHECK(!split.tensor);
      auto mine = make(split);
      // Each rank's mean over its positions, over n: the ranks' losses add up to the whole's.
      const Tensor loss =
          split.cross_entropy((*mine)(split.local_inputs(tokens)), split.local_sequence(targets)) /
          double(n);
      Tensor total = loss.detach().clone();
      dist::all_reduce(total, dist::ReduceOp::Sum, mesh.context());
      CHECK(close(total, whole_loss, 1e-12));
      loss.backward();
      const auto want = whole->named_parameters();
      const auto got = mine->named_parameters();
      REQUIRE(got.size() == want.size());
      for (size_t i = 0; i < got.size(); ++i) {
        const std::string name = got[i].first;
        CAPTURE(name);
        Tensor grad = got[i].second.grad().clone();  // this rank's positions' part
        dist::all_reduce(grad, dist::ReduceOp::Sum, mesh.context());
        CHECK(close(grad, want[i].second.grad(), 1e-12));
      }
    }
  }
}

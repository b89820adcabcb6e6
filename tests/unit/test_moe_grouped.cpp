// The experts as grouped GEMMs against the loop they replace (each expert its own module): the
// layer's values and every gradient, with and without drops, gated or not, with a shared expert,
// and a Llama with experts whose hidden states the switch leaves unchanged. The selection bias
// (DeepSeek-V3's balancing without an auxiliary loss) against its rule, balancing a skewed
// router, and the routing metrics.
#include <doctest/doctest.h>

#include <algorithm>
#include <vector>

#include "helpers.h"
#include "weave/weave.h"

using namespace weave;

namespace {

struct Outcome {
  Tensor y;
  std::vector<Tensor> grads;  // x's, then every parameter's
  int64_t dropped = 0;
};

Outcome run(nn::MoE& moe, const Tensor& x, const Tensor& w) {
  moe.zero_grad();
  const Tensor input = x.detach().requires_grad_();
  const Tensor y = moe(input);
  ((y * w).sum() + moe.aux_loss()).backward();
  Outcome out{y.detach(), {input.grad()}, moe.stats().dropped};
  for (const Tensor& p : moe.parameters()) out.grads.push_back(p.grad());
  return out;
}

nn::MoEOptions fine_grained(bool gated, double capacity) {
  return {.hidden = 8,
          .ffn = 6,
          .router = {.experts = 32,
                     .top_k = 8,
                     .capacity_factor = capacity,
                     .aux_loss_coef = 0.1,
                     .z_loss_coef = 0.01},
          .seed = 5,
          .gated = gated,
          .shared_ffn = gated ? 5 : 0,
          .shared_gate = gated};
}

// Tokens whose first feature is 4: a router row that weighs it sends them all one way.
Tensor skewed_tokens(int64_t t, int64_t hidden, uint64_t seed) {
  Generator g(seed);
  Tensor x = randn({t, hidden}, {.dtype = kFloat64}, &g);
  NoGradGuard no_grad;
  x.narrow(1, 0, 1).fill_(4.0);
  return x;
}

}  // namespace

TEST_SUITE("moe_grouped") {
  TEST_CASE("grouped experts equal the per-expert loop, values and gradients") {
    for (const bool gated : {false, true})
      for (const double capacity : {0.0, 0.5})
        for (const DType dtype : {kFloat64, kFloat32}) {
          CAPTURE(gated);
          CAPTURE(capacity);
          CAPTURE(dtype);
          nn::MoEOptions o = fine_grained(gated, capacity);
          nn::MoE grouped(o);
          o.grouped = false;
          nn::MoE loop(o);
          grouped.to(dtype);
          loop.to(dtype);
          Generator g(17);
          const Tensor x = randn({20, 8}, {.dtype = dtype}, &g);
          const Tensor w = randn({20, 8}, {.dtype = dtype}, &g);
          const Outcome a = run(grouped, x, w), b = run(loop, x, w);
          const double rtol = dtype == kFloat64 ? 1e-12 : 1e-5, atol = rtol * 1e-2;
          CHECK(test::close(a.y, b.y, rtol, atol));
          REQUIRE(a.grads.size() == b.grads.size());
          for (size_t i = 0; i < a.grads.size(); ++i) {
            CAPTURE(i);
            REQUIRE(a.grads[i].defined());
            CHECK(test::close(a.grads[i], b.grads[i], rtol, atol));
          }
          CHECK(a.dropped == b.dropped);
          CHECK((capacity > 0) == (a.dropped > 0));
        }
  }

  TEST_CASE("under autocast the grouped experts compute in bfloat16 as the loop does") {
    nn::MoEOptions o = fine_grained(true, 0.0);
    nn::MoE grouped(o);
    o.grouped = false;
    nn::MoE loop(o);
    Generator g(23);
    const Tensor x = randn({20, 8}, {}, &g), w = randn({20, 8}, {}, &g);
    AutocastGuard autocast(kBFloat16);
    const Outcome a = run(grouped, x, w), b = run(loop, x, w);
    CHECK(a.y.dtype() == b.y.dtype());
    CHECK(test::close(a.y.to(kFloat32), b.y.to(kFloat32), 1e-2, 1e-2));
    for (size_t i = 0; i < a.grads.size(); ++i) {
      CAPTURE(i);
      CHECK(a.grads[i].dtype() == b.grads[i].dtype());
      CHECK(test::close(a.grads[i].to(kFloat32), b.grads[i].to(kFloat32), 2e-2, 2e-2));
    }
  }

  TEST_CASE("a Llama with experts keeps its hidden states when the experts run grouped") {
    std::vector<std::vector<Tensor>> hidden(2);
    std::vector<Tensor> logits;
    for (const bool grouped : {true, false}) {
      Generator init(4);
      nn::MoEOptions moe{.hidden = 16, .ffn = 12, .router = {.experts = 8, .top_k = 2}, .seed = 3};
      moe.gated = true;
      moe.grouped = grouped;
      models::Llama model({.vocab = 40,
                           .dim = 16,
                           .layers = 2,
                           .block = {.heads = 4, .kv_heads = 2, .moe = moe},
                           .generator = &init});
      model.to(kFloat64);
      for (size_t b = 0; b < model.blocks->size(); ++b)
        (void)(*model.blocks)[b].register_forward_hook(
            [&hidden, grouped](nn::Module&, const Tensor&, const Tensor& out) {
              hidden[grouped ? 0 : 1].push_back(out.detach());
              return Tensor();
            });
      Generator g(9);
      logits.push_back(model(randint(0, 40, {2, 7}, {.dtype = kInt64}, &g)).detach());
    }
    REQUIRE(hidden[0].size() == 2);
    REQUIRE(hidden[1].size() == 2);
    for (size_t b = 0; b < 2; ++b) CHECK(test::close(hidden[0][b], hidden[1][b], 1e-12, 1e-14));
    CHECK(test::close(logits[0], logits[1], 1e-12, 1e-14));
  }

  TEST_CASE("grouped_linear checks its groups") {
    const Tensor x = zeros({5, 4});
    const std::vector<Tensor> w{zeros({3, 4}), zeros({3, 4})};
    CHECK_WEAVE_ERROR(grouped_linear(x, w, {2, 2}), "grouped_linear", "the groups count 4 rows");
    CHECK_WEAVE_ERROR(grouped_linear(x, w, {5}), "grouped_linear", "one row count per weight");
    CHECK_WEAVE_ERROR(grouped_linear(x, {zeros({3, 4}), zeros({2, 4})}, {2, 3}), "grouped_linear",
                      "of one shape");
    CHECK_WEAVE_ERROR(grouped_linear(x, w, {6, -1}), "grouped_linear", "expected 0 or more");
    CHECK_WEAVE_ERROR(grouped_linear(x, w, {2, 3}, {zeros({2})}), "grouped_linear",
                      "one per weight");
  }

  TEST_CASE("the selection bias picks, the unbiased scores weigh, the update follows the sign") {
    nn::TopKRouter router(2, {.experts = 3, .top_k = 1, .bias_update_rate = 0.25});
    router.to(kFloat64);
    REQUIRE(router.expert_bias().defined());
    CHECK(router.expert_bias().to_vector<double>() == std::vector<double>{0, 0, 0});
    NoGradGuard no_grad;
    router.weight.copy_(from_vector<double>({1, 0, 0, 1, 0, 0}, {3, 2}));
    const Tensor x = from_vector<double>({1, 0.5}, {1, 2});  // logits 1, 0.5, 0: expert 0
    CHECK(router.route(x).expert.item<int64_t>() == 0);
    // Loads 6, 1, 2 (mean 3): the busy expert down, the idle ones up.
    router.update_bias({6, 1, 2});
    router.update_bias({6, 1, 2});
    router.update_bias({5, 1, 3});  // expert 2 at the mean: unchanged
    CHECK(router.expert_bias().to_vector<double>() == std::vector<double>{-0.75, 0.75, 0.5});
    // Biased scores 0.51 - 0.75, 0.31 + 0.75, 0.19 + 0.5 (the softmax of 1, 0.5, 0): expert 1
    // is chosen, weighted by its unbiased probability (top 1 is not renormalized: Switch's).
    const nn::Routing r = router.route(x);
    CHECK(r.expert.item<int64_t>() == 1);
    CHECK(r.weight.item<double>() ==
          doctest::Approx(softmax(router(x), -1).to_vector<double>()[1]).epsilon(1e-15));
    // Top 2 of softmax gates without renormalizing: the unbiased probabilities.
    nn::TopKRouter two(2, {.experts = 3, .top_k = 2, .renormalize = false, .bias_update_rate = 1});
    two.to(kFloat64);
    two.weight.copy_(router.weight);
    two.update_bias({9, 0, 0});  // expert 0 down by 1, the others up by 1
    const nn::Routing r2 = two.route(x);
    const auto probs = softmax(two(x), -1).to_vector<double>();
    const auto experts = r2.expert.to_vector<int64_t>();
    const auto weights = r2.weight.to_vector<double>();
    CHECK(std::find(experts.begin(), experts.end(), 0) == experts.end());
    for (size_t j = 0; j < 2; ++j)
      CHECK(weights[j] == doctest::Approx(probs[size_t(experts[j])]).epsilon(1e-15));
  }

  TEST_CASE("bias balancing brings a skewed router within 20% of the mean load in 50 steps") {
    nn::MoE moe({.hidden = 8,
                 .ffn = 6,
                 .router = {.experts = 8,
                            .top_k = 2,
                            .gate = nn::Gate::Sigmoid,
                            .aux_loss_coef = 0,
                            .bias_update_rate = 0.01},
                 .seed = 2,
                 .gated = true});
    moe.to(kFloat64);
    {
      NoGradGuard no_grad;  // expert 0's logit: the first feature (4): first for everyone
      moe.router().weight.narrow(0, 0, 1).narrow(1, 0, 1).fill_(0.5);
    }
    optim::SGD sgd(moe.parameters(), {.lr = 0.01});
    const auto max_over_mean = [&] {
      const std::vector<int64_t>& load = moe.stats().load;
      return double(*std::max_element(load.begin(), load.end())) * double(load.size()) /
             double(moe.stats().assignments);
    };
    std::vector<double> ratio;
    for (int step = 0; step < 50; ++step) {
      const Tensor x = skewed_tokens(1024, 8, uint64_t(step));
      sgd.zero_grad();
      mse_loss(moe(x), x * 0.5).backward();
      if (step == 0) CHECK(moe.stats().load[0] > 800);  // of 1024 tokens
      sgd.step();
      ratio.push_back(max_over_mean());
      nn::update_expert_biases(moe);
    }
    // The busiest expert had over 3 x the mean load; it falls within 20% of the mean, and the
    // sign rule's fixed steps keep it near there (the last steps swing between about 1.05 and
    // 1.4: each step of the bias moves the tokens near an expert's threshold).
    CHECK(ratio.front() > 3);
    const auto balanced =
        std::find_if(ratio.begin(), ratio.end(), [](double r) { return r <= 1.2; });
    CHECK(balanced != ratio.end());
    CHECK(*std::max_element(ratio.end() - 10, ratio.end()) < 1.45);
    const auto metrics = nn::routing_metrics(moe);
    REQUIRE(metrics.size() == 2);
    CHECK(metrics[0].first == "moe/max_load");
    CHECK(metrics[0].second == doctest::Approx(ratio.back()));
    CHECK(metrics[1].first == "moe/dropped");
    CHECK(metrics[1].second == 0.0);
    // The bias is saved with the model.
    const auto state = moe.state_dict();
    const auto found = std::find_if(state.begin(), state.end(),
                                    [](const auto& e) { return e.first == "router.expert_bias"; });
    REQUIRE(found != state.end());
    CHECK(found->second.to(kFloat64).to_vector<double>()[0] < 0);
  }

  TEST_CASE("a bad bias rate raises") {
    CHECK_WEAVE_ERROR(nn::TopKRouter(4, {.experts = 2, .top_k = 1, .bias_update_rate = -0.1}),
                      "TopKRouter", "bias_update_rate");
  }
}

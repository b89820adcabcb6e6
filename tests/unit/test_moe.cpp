// Mixture of experts on one process: the layer against a token-by-token loop over the chosen
// experts (with and without capacity drops), the router's capacity order and auxiliary losses
// against their formulas, gradients by finite differences, and bad options.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "helpers.h"
#include "weave/weave.h"

using namespace weave;

namespace {

Tensor tokens(int64_t t, int64_t hidden, uint64_t seed) {
  Generator g(seed);
  return randn({t, hidden}, {.dtype = kFloat64}, &g);
}

nn::MoEOptions options(double capacity_factor, nn::Gate gate = nn::Gate::Softmax) {
  return {.hidden = 4,
          .ffn = 6,
          .router = {.experts = 4,
                     .top_k = 2,
                     .gate = gate,
                     .capacity_factor = capacity_factor,
                     .aux_loss_coef = 0.1,
                     .z_loss_coef = 0.01},
          .seed = 3};
}

}  // namespace

TEST_SUITE("moe") {
  TEST_CASE("the layer equals a token-by-token loop over the chosen experts") {
    for (double capacity : {0.0, 0.5})
      for (nn::Gate gate : {nn::Gate::Softmax, nn::Gate::Sigmoid}) {
        CAPTURE(capacity);
        CAPTURE(int(gate));
        nn::MoE moe(options(capacity, gate));
        moe.to(kFloat64);
        const Tensor x = tokens(10, 4, 7);
        const Tensor y = moe(x);
        const nn::Routing r = moe.router().route(x);
        const auto expert = r.expert.to_vector<int64_t>();
        const auto weight = r.weight.to_vector<double>();
        const auto kept = r.kept.to(kUInt8).to_vector<uint8_t>();
        int64_t dropped = 0;
        for (int64_t t = 0; t < 10; ++t) {
          Tensor expected = zeros({1, 4}, {.dtype = kFloat64});
          for (int64_t j = 0; j < 2; ++j) {
            const size_t slot = size_t(t * 2 + j);
            if (!kept[slot]) {
              ++dropped;
              CHECK(weight[slot] == 0.0);
              continue;
            }
            expected = expected + moe.expert(expert[slot])(x.narrow(0, t, 1)) * weight[slot];
          }
          CHECK(test::close(y.narrow(0, t, 1), expected, 1e-12, 1e-14));
        }
        CHECK(moe.stats().dropped == dropped);
        CHECK((capacity == 0.0) == (dropped == 0));
      }
  }

  TEST_CASE("an expert routed no token gets a zero gradient, not none") {
    nn::MoEOptions o = options(0.0);
    o.router.experts = 8;
    o.router.top_k = 1;
    nn::MoE moe(o);
    moe.to(kFloat64);
    const Tensor x = tokens(2, 4, 9);  // two tokens: at most two of the eight experts
    moe(x).sum().backward();
    const auto chosen = moe.router().route(x).expert.to_vector<int64_t>();
    for (int64_t e = 0; e < 8; ++e) {
      CAPTURE(e);
      const bool used = std::find(chosen.begin(), chosen.end(), e) != chosen.end();
      for (const Tensor& p : moe.expert(e).parameters()) {
        REQUIRE(p.grad().defined());
        CHECK((max(abs(p.grad())).item<double>() == 0.0) == !used);
      }
    }
  }

  TEST_CASE("capacity keeps first choices first, each in token order") {
    // Tokens prefer experts 0, 1, 0 (then the other); capacity ceil(0.25 * 3 * 2 / 2) = 1. The
    // first choices of tokens 0 and 1 fit; everything else is dropped (in token order token 0's
    // second choice would have taken expert 1 before token 1's first choice).
    nn::TopKRouter router(2, {.experts = 2, .top_k = 2, .capacity_factor = 0.25});
    router.to(kFloat64);
    NoGradGuard no_grad;
    router.weight.copy_(from_vector<double>({1, 0, 0, 1}, {2, 2}));
    const Tensor x = from_vector<double>({2, 1, 0, 3, 1, 0}, {3, 2});
    const nn::Routing r = router.route(x);
    CHECK(r.capacity == 1);
    CHECK(r.expert.to_vector<int64_t>() == std::vector<int64_t>{0, 1, 1, 0, 0, 1});
    CHECK(r.kept.to(kUInt8).to_vector<uint8_t>() == std::vector<uint8_t>{1, 0, 1, 0, 0, 0});
    CHECK(r.dropped == 4);
  }

  TEST_CASE("auxiliary losses follow Switch's and ST-MoE's formulas") {
    nn::TopKRouter router(4, {.experts = 3, .top_k = 1, .aux_loss_coef = 0.5, .z_loss_coef = 0.25});
    router.to(kFloat64);
    const Tensor x = tokens(5, 4, 9);
    const nn::Routing r = router.route(x);
    const Tensor logits = router(x);
    const Tensor probs = softmax(logits, -1);
    std::vector<double> share(3, 0.0);
    for (int64_t e : r.expert.to_vector<int64_t>()) share[size_t(e)] += 1.0 / 5;
    double balance = 0;
    for (int64_t e = 0; e < 3; ++e)
      balance += share[size_t(e)] * mean(probs.narrow(1, e, 1)).item<double>();
    double z = 0;
    for (int64_t t = 0; t < 5; ++t) {
      const auto row = logits.narrow(0, t, 1).to_vector<double>();
      double s = 0;
      for (double v : row) s += std::exp(v);
      z += std::log(s) * std::log(s) / 5;
    }
    CHECK(r.aux_loss.item<double>() ==
          doctest::Approx(3 * balance * 0.5 + z * 0.25).epsilon(1e-12));
  }

  TEST_CASE("gradients of the layer and its auxiliary loss match finite differences") {
    nn::MoE moe(options(0.75));
    moe.to(kFloat64);
    const Tensor x = tokens(6, 4, 11).requires_grad_();
    auto result = autograd::gradcheck(
        [&](const std::vector<Tensor>& in) {
          Tensor y = moe(in[0]);
          return y * y + moe.aux_loss();
        },
        {x});
    CHECK_MESSAGE(result.ok, result.report);
  }

  TEST_CASE("a block's balancing loss rides along: its gradient is aux_loss() added, loss-scaled") {
    // Truth: the block in eval mode (nothing attached) with aux_loss() added to the objective.
    // Training, the objective adds nothing, with and without a GradScaler (whose scale the
    // attached loss must take too, or unscaling shrinks its gradient by the scale).
    nn::TransformerBlock block(4, 2, {.moe = options(0)});
    block.to(kFloat64);
    Generator g(5);
    const Tensor x = randn({2, 3, 4}, {.dtype = kFloat64}, &g);
    const Tensor w = randn({2, 3, 4}, {.dtype = kFloat64}, &g);
    auto gradients = [&](bool training, bool add_aux, bool scaled) {
      block.zero_grad();
      block.train(training);
      Tensor loss = (block(x) * w).sum();
      if (add_aux) loss = loss + block.aux_loss();
      parallel::GradScaler scaler({.init_scale = 1024, .enabled = scaled});
      scaler.scale(loss).backward();
      const std::vector<Tensor> params = block.parameters();
      scaler.unscale_(params);
      std::vector<Tensor> grads;
      for (const Tensor& p : params) grads.push_back(p.grad().clone());
      scaler.step(params, [] {});
      scaler.update();
      return grads;
    };
    const auto truth = gradients(false, true, false);
    for (const bool scaled : {false, true}) {
      CAPTURE(scaled);
      const auto got = gradients(true, false, scaled);
      REQUIRE(got.size() == truth.size());
      for (size_t i = 0; i < got.size(); ++i) CHECK(test::close(got[i], truth[i], 1e-12, 1e-14));
    }
    CHECK(block.aux_loss().item<double>() > 0);
    // A scaler dropped between scale() and update() gives the factor back (else the next
    // training in this process would scale its attached losses); a disabled one never sets it.
    {
      parallel::GradScaler dropped({.init_scale = 8});
      (void)dropped.scale(block.aux_loss());
      CHECK(attached_loss_gradient_factor() == 8);
      parallel::GradScaler disabled({.enabled = false});
      (void)disabled.scale(block.aux_loss());
      CHECK(attached_loss_gradient_factor() == 8);
    }
    CHECK(attached_loss_gradient_factor() == 1);
  }

  TEST_CASE("bad router options raise") {
    CHECK_WEAVE_ERROR(nn::TopKRouter(4, {.experts = 2, .top_k = 3}), "TopKRouter",
                      "must be from 1 to the number of experts");
    CHECK_WEAVE_ERROR(nn::TopKRouter(4, {.experts = 2, .top_k = 1, .capacity_factor = -1}),
                      "TopKRouter", "capacity_factor");
    nn::MoE moe(options(0));
    CHECK_WEAVE_ERROR(moe.router().route(tokens(3, 5, 1)), "TopKRouter", "expected tokens");
  }
}

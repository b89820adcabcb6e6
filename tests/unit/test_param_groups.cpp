// Optimizer parameter groups: weight_decay_groups splits a GPT-like model into decay and no
// decay; a grouped SGD, Adam or AdamW equals, bitwise, one optimizer per group; a flat
// parameter whose parts belong to two groups decays each part by its own group's rate.
#include <doctest/doctest.h>

#include <memory>
#include <string>

#include "helpers.h"
#include "weave/weave.h"

using namespace weave;

namespace {

// Embedding, a linear layer with bias, a layer norm, a bias-free head.
std::shared_ptr<nn::Sequential> make_model() {
  manual_seed(7);
  auto model = std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Embedding>(11, 6), std::make_shared<nn::Linear>(6, 8),
      std::make_shared<nn::LayerNorm>(Shape{8}), std::make_shared<nn::Linear>(8, 11, false)});
  model->to(kFloat64);
  return model;
}

Tensor loss_of(nn::Module& model, int step) {
  Generator g(40 + uint64_t(step));
  Tensor ids = randint(0, 11, {5}, {.dtype = kInt64}, &g);
  return cross_entropy(model.forward(ids), randint(0, 11, {5}, {.dtype = kInt64}, &g));
}

// Trains 5 steps with `make`'s optimizer (given the model) and returns the parameters.
std::vector<Tensor> train(
    const std::function<std::vector<std::unique_ptr<optim::Optimizer>>(nn::Module&)>& make) {
  auto model = make_model();
  auto optimizers = make(*model);
  for (int step = 0; step < 5; ++step) {
    for (auto& o : optimizers) o->zero_grad();
    loss_of(*model, step).backward();
    for (auto& o : optimizers) o->step();
  }
  return model->parameters();
}

}  // namespace

TEST_SUITE("nn") {
  TEST_CASE("weight_decay_groups: no decay for biases, norms and embeddings") {
    auto model = make_model();
    const auto groups = optim::weight_decay_groups(*model, 0.1);
    REQUIRE(groups.size() == 2);
    CHECK(groups[0].weight_decay == 0.1);
    CHECK(groups[1].weight_decay == 0.0);
    auto named = model->named_parameters();
    auto in = [&](const optim::ParamGroup& g, const std::string& name) {
      for (const auto& [n, p] : named)
        if (n == name)
          for (const Tensor& q : g.params)
            if (q.is_same(p)) return true;
      return false;
    };
    CHECK(in(groups[0], "1.weight"));
    CHECK(in(groups[0], "3.weight"));
    for (const char* name : {"0.weight", "1.bias", "2.weight", "2.bias"}) {
      CAPTURE(name);
      CHECK(in(groups[1], name));
    }
    CHECK(groups[0].params.size() + groups[1].params.size() == named.size());
  }

  TEST_CASE("a grouped optimizer equals one optimizer per group, bitwise") {
    using Optimizers = std::vector<std::unique_ptr<optim::Optimizer>>;
    for (int kind = 0; kind < 3; ++kind) {  // SGD with momentum, Adam (L2), AdamW (decoupled)
      CAPTURE(kind);
      auto make =
          [kind](std::vector<optim::ParamGroup> groups) -> std::unique_ptr<optim::Optimizer> {
        if (kind == 0)
          return std::make_unique<optim::SGD>(groups,
                                              optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
        if (kind == 1) return std::make_unique<optim::Adam>(groups, optim::AdamOptions{.lr = 0.01});
        return std::make_unique<optim::AdamW>(groups, optim::AdamWOptions{.lr = 0.01});
      };
      const auto grouped = train([&](nn::Module& m) {
        Optimizers o;
        o.push_back(make(optim::weight_decay_groups(m, 0.2)));
        return o;
      });
      const auto separate = train([&](nn::Module& m) {
        Optimizers o;
        for (const optim::ParamGroup& g : optim::weight_decay_groups(m, 0.2))
          o.push_back(make({g}));
        return o;
      });
      const auto uniform = train([&](nn::Module& m) {  // everything decays: not the same run
        Optimizers o;
        o.push_back(make({{.params = m.parameters(), .weight_decay = 0.2}}));
        return o;
      });
      for (size_t i = 0; i < grouped.size(); ++i) {
        CAPTURE(i);
        CHECK(equal(grouped[i], separate[i]));
      }
      CHECK_FALSE(equal(grouped[2], uniform[2]));  // the layer-norm scale decays only there
    }
  }

  TEST_CASE("a flat parameter in two groups decays each part at its group's rate") {
    for (bool decoupled : {true, false}) {
      CAPTURE(decoupled);
      manual_seed(3);
      Tensor flat = randn({10}, {.dtype = kFloat64}).requires_grad_();
      Tensor a = flat.detach().narrow(0, 0, 4).clone().requires_grad_();
      Tensor b = flat.detach().narrow(0, 4, 6).clone().requires_grad_();
      std::unique_ptr<optim::Optimizer> parts, whole;
      const std::vector<optim::ParamGroup> split = {
          {.params = {flat}, .weight_decay = 0.3, .ranges = {{0, 4}}},
          {.params = {flat}, .weight_decay = 0.0, .ranges = {{4, 10}}}};
      const std::vector<optim::ParamGroup> apart = {{.params = {a}, .weight_decay = 0.3},
                                                    {.params = {b}, .weight_decay = 0.0}};
      if (decoupled) {
        parts = std::make_unique<optim::AdamW>(split, optim::AdamWOptions{.lr = 0.05});
        whole = std::make_unique<optim::AdamW>(apart, optim::AdamWOptions{.lr = 0.05});
      } else {
        parts = std::make_unique<optim::SGD>(split, optim::SGDOptions{.lr = 0.05});
        whole = std::make_unique<optim::SGD>(apart, optim::SGDOptions{.lr = 0.05});
      }
      for (int step = 0; step < 4; ++step) {
        Tensor target = full({10}, double(step));
        parts->zero_grad();
        whole->zero_grad();
        sum((flat - target) * (flat - target)).backward();
        sum((cat({a, b}, 0) - target) * (cat({a, b}, 0) - target)).backward();
        parts->step();
        whole->step();
      }
      CHECK(allclose(flat.detach(), cat({a.detach(), b.detach()}, 0), 1e-14, 1e-15));
    }
    Tensor p = randn({4}).requires_grad_();
    CHECK_WEAVE_ERROR(
        optim::SGD(
            std::vector<optim::ParamGroup>{{.params = {p}, .weight_decay = 0.1}, {.params = {p}}},
            optim::SGDOptions{}),
        "optimizer", "is in two groups");
    CHECK_WEAVE_ERROR(
        optim::SGD(std::vector<optim::ParamGroup>{{.params = {p}, .ranges = {{2, 9}}}},
                   optim::SGDOptions{}),
        "optimizer", "the range [2, 9)");
  }
}

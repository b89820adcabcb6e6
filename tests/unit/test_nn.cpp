#include <cmath>

#include "helpers.h"

using namespace weave;

namespace {
std::shared_ptr<nn::Sequential> small_mlp() {
  return std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(4, 3), nn::ReLU(), std::make_shared<nn::Linear>(3, 2, false)});
}
}  // namespace

TEST_SUITE("nn") {
  TEST_CASE("named parameters are deterministic") {
    auto model = small_mlp();
    auto named = model->named_parameters();
    REQUIRE(named.size() == 3);
    CHECK(named[0].first == "0.weight");
    CHECK(named[1].first == "0.bias");
    CHECK(named[2].first == "2.weight");
    CHECK(named[0].second.shape() == Shape{3, 4});
    for (auto& [name, p] : named) CHECK(p.requires_grad());
  }

  TEST_CASE("seeded initialization is reproducible and in range") {
    manual_seed(5);
    nn::Linear a(100, 50);
    manual_seed(5);
    nn::Linear b(100, 50);
    CHECK(equal(a.weight, b.weight));
    CHECK(max(abs(a.weight)).item() <= 0.1 + 1e-7);
    Tensor w = empty({200, 100});
    Generator g(1);
    nn::init::kaiming_uniform_(w, 0, nn::init::FanMode::FanIn, "relu", &g);
    CHECK(max(abs(w)).item() <= std::sqrt(6.0 / 100) + 1e-6);
    nn::init::xavier_normal_(w, 1.0, &g);
    CHECK(std::sqrt(var(w).item()) == doctest::Approx(std::sqrt(2.0 / 300)).epsilon(0.05));
  }

  TEST_CASE("state dict round trip") {
    auto a = small_mlp(), b = small_mlp();
    b->load_state_dict(a->state_dict());
    Tensor x = randn({5, 4});
    CHECK(equal((*a)(x), (*b)(x)));
    auto state = a->state_dict();
    state.pop_back();
    CHECK_WEAVE_ERROR(b->load_state_dict(state), "load_state_dict", "missing key '2.weight'");
    state = a->state_dict();
    state.emplace_back("extra", ones({1}));
    CHECK_WEAVE_ERROR(b->load_state_dict(state), "load_state_dict", "unexpected key 'extra'");
    b->load_state_dict(state, false);
    state = a->state_dict();
    state[0].second = ones({2, 2});
    CHECK_WEAVE_ERROR(b->load_state_dict(state), "load_state_dict", "shape");
  }

  TEST_CASE("train and eval modes") {
    nn::Sequential model{std::make_shared<nn::Dropout>(0.5)};
    Tensor x = ones({1000});
    model.eval();
    CHECK(equal(model(x), x));
    model.train();
    Tensor y = model(x);
    double kept = sum(gt(y, scalar_tensor(0))).item();
    CHECK(kept == doctest::Approx(500).epsilon(0.15));
    CHECK(max(y).item() == doctest::Approx(2.0));
  }

  TEST_CASE("SGD matches hand-computed updates") {
    Tensor p = from_vector<double>({1.0, -2.0}).requires_grad_();
    optim::SGD sgd({p}, {.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01});
    // step 1: d = g + 0.01 p; buf = d; p -= 0.1 buf
    p.set_grad(from_vector<double>({0.5, 0.5}));
    sgd.step();
    double d0 = 0.5 + 0.01 * 1.0, d1 = 0.5 + 0.01 * -2.0;
    double p0 = 1.0 - 0.1 * d0, p1 = -2.0 - 0.1 * d1;
    CHECK(p.to_vector<double>()[0] == doctest::Approx(p0));
    CHECK(p.to_vector<double>()[1] == doctest::Approx(p1));
    // step 2: buf = 0.9 buf + d'
    p.set_grad(from_vector<double>({1.0, -1.0}));
    sgd.step();
    double b0 = 0.9 * d0 + (1.0 + 0.01 * p0), b1 = 0.9 * d1 + (-1.0 + 0.01 * p1);
    CHECK(p.to_vector<double>()[0] == doctest::Approx(p0 - 0.1 * b0));
    CHECK(p.to_vector<double>()[1] == doctest::Approx(p1 - 0.1 * b1));

    Tensor q = from_vector<double>({1.0}).requires_grad_();
    optim::SGD nesterov({q}, {.lr = 0.5, .momentum = 0.5, .nesterov = true});
    q.set_grad(from_vector<double>({2.0}));
    nesterov.step();  // buf = 2; d = 2 + 0.5 * 2 = 3; q = 1 - 1.5
    CHECK(q.item() == doctest::Approx(-0.5));
  }

  TEST_CASE("Adam and AdamW match hand-computed updates") {
    Tensor p = from_vector<double>({1.0, 2.0}).requires_grad_();
    optim::Adam adam({p}, {.lr = 0.1});
    p.set_grad(from_vector<double>({0.3, -4.0}));
    adam.step();  // first step: m_hat = g, v_hat = g^2, so p -= lr * g / (|g| + eps)
    CHECK(p.to_vector<double>()[0] == doctest::Approx(0.9));
    CHECK(p.to_vector<double>()[1] == doctest::Approx(2.1));
    p.set_grad(from_vector<double>({0.1, -4.0}));
    adam.step();
    double m = 0.9 * 0.1 * 0.3 + 0.1 * 0.1, v = 0.999 * 0.001 * 0.09 + 0.001 * 0.01;
    double m_hat = m / (1 - 0.81), v_hat = v / (1 - 0.999 * 0.999);
    CHECK(p.to_vector<double>()[0] ==
          doctest::Approx(0.9 - 0.1 * m_hat / (std::sqrt(v_hat) + 1e-8)));

    Tensor w = from_vector<double>({1.0}).requires_grad_();
    optim::AdamW adamw({w}, {.lr = 0.1, .weight_decay = 0.5});
    w.set_grad(from_vector<double>({2.0}));
    adamw.step();  // w = 1 * (1 - 0.05) - 0.1 * 1
    CHECK(w.item() == doctest::Approx(0.85));
  }

  TEST_CASE("the fused Adam step equals the step written with tensor ops") {
    // A contiguous parameter takes the fused kernel; a transposed view of the same values
    // takes the op-by-op path. Both must agree, for Adam (L2) and AdamW (decoupled).
    for (bool decoupled : {false, true}) {
      CAPTURE(decoupled);
      Generator g(3);
      Tensor start = randn({4, 6}, {.dtype = kFloat64}, &g);
      Tensor fused = start.clone().requires_grad_();
      Tensor strided = start.t().contiguous().t().detach().requires_grad_();  // same values
      REQUIRE_FALSE(strided.is_contiguous());
      std::unique_ptr<optim::Optimizer> a, b;
      if (decoupled) {
        a = std::make_unique<optim::AdamW>(std::vector<Tensor>{fused},
                                           optim::AdamWOptions{.lr = 0.05, .weight_decay = 0.1});
        b = std::make_unique<optim::AdamW>(std::vector<Tensor>{strided},
                                           optim::AdamWOptions{.lr = 0.05, .weight_decay = 0.1});
      } else {
        a = std::make_unique<optim::Adam>(std::vector<Tensor>{fused},
                                          optim::AdamOptions{.lr = 0.05, .weight_decay = 0.1});
        b = std::make_unique<optim::Adam>(std::vector<Tensor>{strided},
                                          optim::AdamOptions{.lr = 0.05, .weight_decay = 0.1});
      }
      for (int step = 0; step < 4; ++step) {
        Tensor grad = randn({4, 6}, {.dtype = kFloat64}, &g);
        fused.set_grad(grad.clone());
        strided.set_grad(grad.t().contiguous().t());
        a->step();
        b->step();
      }
      CHECK(allclose(fused, strided, 1e-13, 1e-15));
      CHECK(allclose(a->state()[1], b->state()[1], 1e-13, 1e-15));
    }
  }

  TEST_CASE("the fused SGD step equals the step written with tensor ops") {
    // Contiguous parameters take the fused kernel, transposed views of the same values the
    // op-by-op path: every combination of momentum, dampening, Nesterov and weight decay, in
    // float64 (to rounding) and float32 (to float32 rounding).
    struct Case {
      double momentum, dampening, weight_decay;
      bool nesterov;
    };
    for (DType dtype : {kFloat64, kFloat32})
      for (Case c : {Case{0, 0, 0, false}, Case{0, 0, 0.1, false}, Case{0.9, 0, 0, false},
                     Case{0.9, 0.2, 0.05, false}, Case{0.9, 0, 0.05, true}}) {
        CAPTURE(dtype);
        CAPTURE(c.momentum);
        CAPTURE(c.nesterov);
        Generator g(5);
        Tensor start = randn({5, 7}, {.dtype = dtype}, &g);
        Tensor fused = start.clone().requires_grad_();
        Tensor strided = start.t().contiguous().t().detach().requires_grad_();
        REQUIRE_FALSE(strided.is_contiguous());
        const optim::SGDOptions options{.lr = 0.05,
                                        .momentum = c.momentum,
                                        .dampening = c.dampening,
                                        .weight_decay = c.weight_decay,
                                        .nesterov = c.nesterov};
        optim::SGD a({fused}, options), b({strided}, options);
        for (int step = 0; step < 4; ++step) {
          Tensor grad = randn({5, 7}, {.dtype = dtype}, &g);
          fused.set_grad(grad.clone());
          strided.set_grad(grad.t().contiguous().t());
          a.step();
          b.step();
        }
        const double rtol = dtype == kFloat64 ? 1e-13 : 2e-6;
        CHECK(allclose(fused, strided, rtol, rtol * 1e-2));
        CHECK(a.state().size() == b.state().size());
        for (size_t i = 0; i < a.state().size(); ++i)
          CHECK(allclose(a.state()[i], b.state()[i], rtol, rtol * 1e-2));
        CHECK_FALSE(allclose(fused, start, 1e-3, 1e-3));  // it moved
      }
  }

  TEST_CASE("AdamW keeps its default weight decay when other options are given") {
    // One step from w = 2 with gradient 1: w -= lr * wd * w, then w -= lr * g / (|g| + eps).
    auto step_from_two = [](auto make_optimizer) {
      Tensor w = from_vector<double>({2.0}).requires_grad_();
      auto optimizer = make_optimizer(w);
      w.set_grad(from_vector<double>({1.0}));
      optimizer.step();
      return w.item();
    };
    const double expected = 2.0 - 1e-3 * 0.01 * 2.0 - 1e-3 / (1.0 + 1e-8);
    CHECK(step_from_two([](Tensor w) { return optim::AdamW({w}); }) ==
          doctest::Approx(expected).epsilon(1e-12));
    CHECK(step_from_two([](Tensor w) { return optim::AdamW({w}, {.lr = 1e-3}); }) ==
          doctest::Approx(expected).epsilon(1e-12));
    CHECK(step_from_two([](Tensor w) { return optim::AdamW({w}, {.eps = 1e-8}); }) ==
          doctest::Approx(expected).epsilon(1e-12));
    // Adam's default stays no decay.
    CHECK(step_from_two([](Tensor w) { return optim::Adam({w}, {.lr = 1e-3}); }) ==
          doctest::Approx(2.0 - 1e-3 / (1.0 + 1e-8)).epsilon(1e-12));
  }

  TEST_CASE("learning-rate schedules") {
    auto step = optim::step_schedule(1.0, 10, 0.5);
    CHECK(step(9) == 1.0);
    CHECK(step(10) == 0.5);
    CHECK(step(25) == 0.25);
    auto cosine = optim::cosine_schedule(1.0, 100, 0.1);
    CHECK(cosine(0) == doctest::Approx(1.0));
    CHECK(cosine(50) == doctest::Approx(0.55));
    CHECK(cosine(100) == doctest::Approx(0.1));
    auto warm = optim::linear_warmup(cosine, 4);
    CHECK(warm(0) == doctest::Approx(0.25));
    CHECK(warm(3) == doctest::Approx(1.0));
    CHECK(warm(54) == doctest::Approx(0.55));
    Tensor p = zeros({1}).requires_grad_();
    optim::SGD sgd({p}, {.lr = 7});
    optim::LRScheduler scheduler(sgd, step);
    CHECK(sgd.lr() == 1.0);
    for (int i = 0; i < 10; ++i) scheduler.step();
    CHECK(sgd.lr() == 0.5);
  }

  TEST_CASE("clip_grad_norm_") {
    Tensor a = zeros({2}).requires_grad_(), b = zeros({1}).requires_grad_();
    a.set_grad(from_vector<float>({3, 0}));
    b.set_grad(from_vector<float>({4}));
    double norm = optim::clip_grad_norm_({a, b}, 1.0);
    CHECK(norm == doctest::Approx(5.0));
    CHECK(a.grad().to_vector<float>()[0] == doctest::Approx(0.6).epsilon(1e-4));
    CHECK(b.grad().item() == doctest::Approx(0.8).epsilon(1e-4));
    CHECK(optim::clip_grad_norm_({a, b}, 10.0, INFINITY) == doctest::Approx(0.8).epsilon(1e-4));
  }

  TEST_CASE("clip_grad_norm_ over many parameters of several dtypes equals the norm by hand") {
    // More parameters than one multi-tensor launch takes, in three dtypes, some empty.
    Generator g(11);
    const DType dtypes[] = {kFloat32, kBFloat16, kFloat64};
    std::vector<Tensor> params;
    for (int i = 0; i < 45; ++i) {
      Tensor p = zeros({i % 7 == 0 ? 0 : 3 + i * 5}, {.dtype = dtypes[i % 3]}).requires_grad_();
      p.set_grad(randn(p.shape(), {.dtype = p.dtype()}, &g));
      params.push_back(p);
    }
    for (double norm_type : {1.0, 2.0, 3.0, double(INFINITY)}) {
      CAPTURE(norm_type);
      std::vector<Tensor> before;
      double expected = 0;
      for (const Tensor& p : params) {
        before.push_back(p.grad().clone());
        for (double v : p.grad().to(kFloat64).to_vector<double>())
          expected = std::isinf(norm_type) ? std::max(expected, std::abs(v))
                                           : expected + std::pow(std::abs(v), norm_type);
      }
      if (!std::isinf(norm_type)) expected = std::pow(expected, 1 / norm_type);
      const double max_norm = 0.5;
      const double norm = optim::clip_grad_norm_(params, max_norm, norm_type);
      CHECK(norm == doctest::Approx(expected).epsilon(1e-12));
      const double scale = max_norm / (expected + 1e-6);
      for (size_t i = 0; i < params.size(); ++i)
        CHECK(allclose(params[i].grad().to(kFloat64), before[i].to(kFloat64) * scale,
                       params[i].dtype() == kBFloat16 ? 1e-2 : 1e-6, 0));
      for (size_t i = 0; i < params.size(); ++i) params[i].set_grad(before[i]);
    }
  }

  TEST_CASE("clip_grad_norm_ rejects a bad max_norm and reports non-finite gradients") {
    Tensor a = zeros({2}).requires_grad_();
    a.set_grad(from_vector<float>({3, 4}));
    CHECK_WEAVE_ERROR(optim::clip_grad_norm_({a}, -1.0), "clip_grad_norm_", "found -1");
    CHECK_WEAVE_ERROR(optim::clip_grad_norm_({a}, std::nan("")), "clip_grad_norm_", "found nan");
    CHECK(a.grad().to_vector<float>() == std::vector<float>{3, 4});        // untouched
    CHECK(optim::clip_grad_norm_({a}, INFINITY) == doctest::Approx(5.0));  // measures only
    for (double norm_type : {2.0, 1.0, double(INFINITY)}) {
      CAPTURE(norm_type);
      a.set_grad(from_vector<float>({std::nanf(""), 4}));
      CHECK_WEAVE_ERROR(optim::clip_grad_norm_({a}, 1.0, norm_type, true), "clip_grad_norm_",
                        "holds NaN or infinity");
      CHECK(a.grad().to_vector<float>()[1] == 4.0f);  // the error leaves them unchanged
      // Without the flag, PyTorch's behaviour: the norm is NaN and so is every gradient.
      CHECK(std::isnan(optim::clip_grad_norm_({a}, 1.0, norm_type)));
      CHECK(std::isnan(a.grad().to_vector<float>()[1]));
      a.set_grad(from_vector<float>({INFINITY, 4}));
      CHECK_WEAVE_ERROR(optim::clip_grad_norm_({a}, 1.0, norm_type, true), "clip_grad_norm_",
                        "is inf");
    }
  }

  TEST_CASE("a model trains: loss falls on a separable problem") {
    manual_seed(3);
    Tensor x = randn({256, 2});
    Tensor y = gt(x.select(1, 0) + x.select(1, 1), scalar_tensor(0)).to(kInt64);
    nn::Sequential model{std::make_shared<nn::Linear>(2, 16), nn::Tanh(),
                         std::make_shared<nn::Linear>(16, 2)};
    optim::Adam opt(model.parameters(), {.lr = 0.05});
    double first = 0, last = 0;
    for (int step = 0; step < 100; ++step) {
      Tensor loss = cross_entropy(model(x), y);
      if (step == 0) first = loss.item();
      last = loss.item();
      opt.zero_grad();
      loss.backward();
      opt.step();
    }
    CHECK(last < first * 0.2);
    double accuracy = mean(eq(argmax(model(x), 1), y).to(kFloat32)).item();
    CHECK(accuracy > 0.95);
  }

  TEST_CASE("summary lists each module with its parameter count, and the totals") {
    models::Llama model({.vocab = 32, .dim = 8, .layers = 2, .block = {.heads = 2, .hidden = 16}});
    const nn::ParameterCount count = nn::count_parameters(model);
    int64_t expected = 0;
    for (const Tensor& p : model.parameters()) expected += p.numel();
    CHECK(count.total == expected);
    CHECK(count.trainable == expected);
    CHECK(count.bytes == 4 * expected);
    const std::string table = nn::summary(model);
    CAPTURE(table);
    // embedding 32 x 8 = 256; each block: two norms (8 each), q (8 x 8), kv (2 x 8 x 8), out
    // (8 x 8), gate_up (32 x 8) and down (8 x 16): 16 + 64 + 128 + 64 + 256 + 128 = 656
    CHECK(table.find("├─ embedding") != std::string::npos);
    CHECK(table.find("256\n") != std::string::npos);
    CHECK(table.find("│  ├─ 0") != std::string::npos);
    CHECK(table.find("656\n") != std::string::npos);
    // + the final norm (8) and the head (32 x 8)
    CHECK(expected == 256 + 2 * 656 + 8 + 256);
    CHECK(table.find("total 1,832 parameters (1.8 K), 1,832 trainable, 0 frozen, 7.2 KB") !=
          std::string::npos);
  }

  TEST_CASE("negative ids raise in an embedding and in generation; NaN logits stop generation") {
    nn::Embedding table(10, 4);
    CHECK_THROWS_WITH_AS(table(from_vector<int64_t>({3, -1}, {2})),
                         doctest::Contains("hint: ids lie in [0, size)"), Error);
    CHECK_THROWS_WITH_AS(table(from_vector<int64_t>({10}, {1})),
                         doctest::Contains("index out of range"), Error);
    models::GPT2 gpt2({.vocab = 16, .dim = 8, .layers = 1, .heads = 2, .max_positions = 32});
    const nn::GenerationOptions two{.max_new_tokens = 2};
    CHECK_THROWS_WITH_AS(nn::generate(gpt2, from_vector<int64_t>({1, -1}, {1, 2}), two),
                         doctest::Contains("prompt ids must lie in [0, 16)"), Error);
    CHECK_THROWS_WITH_AS(nn::generate(gpt2, from_vector<int64_t>({1, 16}, {1, 2}), two),
                         doctest::Contains("found [1, 16]"), Error);
    CHECK(nn::generate(gpt2, from_vector<int64_t>({1, 2}, {1, 2}), two).size(1) == 4);
    {
      NoGradGuard no_grad;
      gpt2.positions->weight.fill_(std::nan(""));
    }
    CHECK_THROWS_WITH_AS(nn::generate(gpt2, from_vector<int64_t>({1, 2}, {1, 2}), two),
                         doctest::Contains("the logits of row 0 hold NaN (first at token 0)"),
                         Error);
    CHECK_THROWS_WITH_AS(
        nn::sample_tokens(from_vector<float>({0, 1, 2, std::nanf("")}, {2, 2}), {}, {0.5, 0.5}),
        doctest::Contains("row 1 hold NaN (first at token 1)"), Error);
    CHECK(nn::sample_tokens(from_vector<float>({0, -INFINITY, 2, 1}, {2, 2}), {}, {0.5, 0.5})
              .to_vector<int64_t>() == std::vector<int64_t>{0, 0});  // -inf bans, it is no NaN
  }
}

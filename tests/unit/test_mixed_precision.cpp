// Reduced precision: bfloat16 / float16 GEMM against the product of the same rounded inputs,
// every op's output dtype and gradients in reduced precision, autocast's policy, optimizers
// on reduced-precision parameters, and the loss scaler's schedule.
#include <cmath>

#include "helpers.h"

using namespace weave;

namespace {

/// Half an ulp relative to the value: the rounding of one result to dtype.
double unit_roundoff(DType dtype) {
  return dtype == kBFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
}

/// Checks that `out` (dtype) is the exact product of a and b (already representable in
/// dtype) rounded once to dtype: each element within the dtype's rounding of the float64
/// product, plus float32 accumulation's error over k terms.
void check_rounded_product(const Tensor& out, const Tensor& a, const Tensor& b, DType dtype) {
  REQUIRE(out.dtype() == dtype);
  const Tensor exact = matmul(a.to(kFloat64), b.to(kFloat64));
  const Tensor magnitude = matmul(abs(a.to(kFloat64)), abs(b.to(kFloat64)));
  const double k = double(a.size(-1));
  const Tensor tolerance =
      abs(exact) * unit_roundoff(dtype) + magnitude * (k * std::ldexp(1.0, -23)) + 1e-30;
  const Tensor excess = abs(out.to(kFloat64) - exact) - tolerance;
  const double worst = max(excess).item<double>();
  CHECK_MESSAGE(worst <= 0, "out of tolerance by ", worst, " for shape ", out.shape());
}

}  // namespace

TEST_SUITE("mixed_precision") {
  TEST_CASE("bfloat16 and float16 matmul equal the rounded product, every layout") {
    Generator gen(7);
    for (DType dtype : {kBFloat16, kFloat16}) {
      CAPTURE(dtype);
      struct Shape3 {
        int64_t m, k, n;
      };
      for (Shape3 s : {Shape3{1, 1, 1}, {7, 13, 5}, {65, 33, 17}, {128, 256, 64}, {3, 300, 2}}) {
        CAPTURE(s.m);
        CAPTURE(s.k);
        CAPTURE(s.n);
        for (int layout = 0; layout < 4; ++layout) {
          const bool ta = layout & 1, tb = layout & 2;
          // transposed operands are views of the other layout (the kernel reads them in place)
          Tensor a = ta ? randn({s.k, s.m}, {}, &gen).to(dtype).t()
                        : randn({s.m, s.k}, {}, &gen).to(dtype);
          Tensor b = tb ? randn({s.n, s.k}, {}, &gen).to(dtype).t()
                        : randn({s.k, s.n}, {}, &gen).to(dtype);
          check_rounded_product(matmul(a, b), a, b, dtype);
        }
      }
      // batched, with one side broadcast over the batch, and linear with its bias
      Tensor a = randn({4, 9, 31}, {}, &gen).to(dtype), b = randn({31, 6}, {}, &gen).to(dtype);
      check_rounded_product(matmul(a, b), a, b, dtype);
      Tensor bb = randn({4, 31, 6}, {}, &gen).to(dtype);
      check_rounded_product(matmul(a, bb), a, bb, dtype);
      Tensor w = randn({6, 31}, {}, &gen).to(dtype), bias = randn({6}, {}, &gen).to(dtype);
      Tensor y = linear(a, w, bias);
      REQUIRE(y.dtype() == dtype);
      // the bias is rounded into the output first, then the product is added in float32
      const Tensor exact = matmul(a.to(kFloat64), w.t().to(kFloat64)) + bias.to(kFloat64);
      CHECK(allclose(y.to(kFloat64), exact, 3 * unit_roundoff(dtype), 1e-2));
    }
  }

  TEST_CASE("float32_matmul_precision: PyTorch's names, highest by default, float32 on the CPU") {
    CHECK(float32_matmul_precision() == "highest");
    Generator g(4);
    Tensor a = randn({33, 70}, {}, &g), b = randn({70, 21}, {}, &g);
    const Tensor full = matmul(a, b);
    for (const char* precision : {"high", "medium"}) {
      set_float32_matmul_precision(precision);
      CHECK(float32_matmul_precision() == "high");  // medium is TF32 too, as on PyTorch's GPUs
      CHECK(equal(matmul(a, b), full));             // the CPU computes float32 at every setting
    }
    CHECK_WEAVE_ERROR(set_float32_matmul_precision("fast"), "set_float32_matmul_precision", "fast");
    CHECK(float32_matmul_precision() == "high");  // an error changes nothing
    set_float32_matmul_precision("highest");
    CHECK(float32_matmul_precision() == "highest");
  }

  TEST_CASE("matmul and linear gradients in bfloat16 match float64 on the rounded values") {
    Generator gen(3);
    Tensor x = randn({5, 8, 16}, {}, &gen).to(kBFloat16).requires_grad_();
    Tensor w = randn({12, 16}, {}, &gen).to(kBFloat16).requires_grad_();
    Tensor bias = randn({12}, {}, &gen).to(kBFloat16).requires_grad_();
    Tensor g = randn({5, 8, 12}, {}, &gen).to(kBFloat16);
    linear(x, w, bias).backward(g);
    REQUIRE(x.grad().dtype() == kBFloat16);
    REQUIRE(w.grad().dtype() == kBFloat16);
    REQUIRE(bias.grad().dtype() == kBFloat16);
    const Tensor g64 = g.to(kFloat64), x64 = x.detach().to(kFloat64);
    const Tensor w64 = w.detach().to(kFloat64);
    CHECK(allclose(x.grad().to(kFloat64), matmul(g64, w64), 1e-2, 1e-2));
    CHECK(allclose(w.grad().to(kFloat64), matmul(g64.reshape({-1, 12}).t(), x64.reshape({-1, 16})),
                   1e-2, 1e-1));
    CHECK(allclose(bias.grad().to(kFloat64), g64.sum({0, 1}), 1e-2, 1e-1));
  }

  TEST_CASE("every op takes bfloat16 and float16, computes in float32, returns the input dtype") {
    Generator gen(11);
    for (DType dtype : {kBFloat16, kFloat16}) {
      CAPTURE(dtype);
      Tensor x32 = randn({6, 40}, {}, &gen).to(dtype).to(kFloat32);  // representable values
      Tensor x = x32.to(dtype);
      Tensor w = (randn({40}, {}, &gen) * 0.1 + 1).to(dtype), b = randn({40}, {}, &gen).to(dtype);
      Tensor target = randint(0, 40, {6}, {.dtype = kInt64}, &gen);
      struct OpCase {
        const char* name;
        std::function<Tensor(const Tensor&)> run;
      };
      const std::vector<OpCase> cases = {
          {"softmax", [](const Tensor& t) { return softmax(t, -1); }},
          {"log_softmax", [](const Tensor& t) { return log_softmax(t, -1); }},
          {"layer_norm",
           [&](const Tensor& t) { return layer_norm(t, {40}, w.to(t.dtype()), b.to(t.dtype())); }},
          {"rms_norm", [&](const Tensor& t) { return rms_norm(t, {40}, w.to(t.dtype())); }},
          {"cross_entropy", [&](const Tensor& t) { return cross_entropy(t, target); }},
          {"gelu", [](const Tensor& t) { return gelu(t); }},
          {"bias_gelu", [&](const Tensor& t) { return bias_gelu(t, b.to(t.dtype())); }},
          {"exp", [](const Tensor& t) { return exp(t); }},
          {"sum", [](const Tensor& t) { return sum(t, {1}); }},
          {"mean", [](const Tensor& t) { return mean(t); }},
          {"attention",
           [](const Tensor& t) {
             Tensor q = t.reshape({1, 2, 3, 40});
             return scaled_dot_product_attention(q, q * 0.5, q, {.causal = true});
           }},
      };
      for (const OpCase& c : cases) {
        CAPTURE(c.name);
        Tensor low = c.run(x), reference = c.run(x32);
        CHECK(low.dtype() == dtype);
        // computed in float32 and rounded once: within the dtype's rounding of the result
        CHECK(allclose(low.to(kFloat32), reference, 2 * unit_roundoff(dtype), 1e-3));
      }
    }
  }

  TEST_CASE("autocast: each op's output dtype, nesting, float32 gradients on the leaves") {
    Generator gen(5);
    Tensor x = randn({4, 8}, {}, &gen), w = randn({6, 8}, {}, &gen).requires_grad_();
    Tensor bias = randn({6}, {}, &gen).requires_grad_();
    Tensor norm_w = ones({6}).requires_grad_();
    CHECK(!autocast_dtype());
    {
      AutocastGuard autocast(kBFloat16);
      REQUIRE(autocast_dtype() == kBFloat16);
      Tensor h = linear(x, w, bias);
      CHECK(h.dtype() == kBFloat16);
      CHECK(matmul(x, x.t()).dtype() == kBFloat16);
      Tensor q = randn({1, 2, 4, 8}, {}, &gen);
      CHECK(scaled_dot_product_attention(q, q, q).dtype() == kBFloat16);
      CHECK(softmax(h, -1).dtype() == kFloat32);
      CHECK(log_softmax(h, -1).dtype() == kFloat32);
      CHECK(exp(h).dtype() == kFloat32);
      CHECK(log(abs(h) + 1).dtype() == kFloat32);
      CHECK(sum(h).dtype() == kFloat32);
      CHECK(mean(h).dtype() == kFloat32);
      CHECK(pow(h, 2.0).dtype() == kFloat32);
      CHECK(mse_loss(h, zeros({4, 6})).dtype() == kFloat32);
      CHECK(relu(h).dtype() == kBFloat16);  // follows its input
      Tensor act = bias_gelu(h, bias);      // linear's epilogue: its float32 bias is cast too
      CHECK(act.dtype() == kBFloat16);
      CHECK((h + zeros({4, 6})).dtype() == kFloat32);                        // follows: promotion
      CHECK(x.to(kFloat64).matmul(x.t().to(kFloat64)).dtype() == kFloat64);  // never autocast
      Tensor n = layer_norm(h, {6}, norm_w);
      CHECK(n.dtype() == kFloat32);
      {
        AutocastGuard inner(kFloat16);
        CHECK(linear(x, w).dtype() == kFloat16);
        AutocastGuard off(kFloat16, false);
        CHECK(!autocast_dtype());
        CHECK(linear(x, w).dtype() == kFloat32);
      }
      {
        // Disabled, any dtype does (AutocastGuard(kFloat32, use_amp) with use_amp false).
        AutocastGuard off(kFloat32, false);
        CHECK(!autocast_dtype());
        CHECK(linear(x, w).dtype() == kFloat32);
      }
      CHECK(autocast_dtype() == kBFloat16);
      Tensor loss =
          cross_entropy(h, randint(0, 6, {4}, {.dtype = kInt64}, &gen)) + sum(n * n) + sum(act);
      CHECK(loss.dtype() == kFloat32);
      loss.backward();
    }
    CHECK(!autocast_dtype());
    REQUIRE(w.grad().defined());
    CHECK(w.grad().dtype() == kFloat32);
    CHECK(bias.grad().dtype() == kFloat32);
    CHECK(norm_w.grad().dtype() == kFloat32);

    // The gradient through the casts is the cast back: equal to the float32 graph of the same
    // bfloat16-rounded operands, within bfloat16's rounding of the product.
    Tensor w2 = w.detach().clone().requires_grad_();
    Tensor y;
    {
      AutocastGuard autocast(kBFloat16);
      y = linear(x, w2);
    }
    Tensor g = randn({4, 6}, {}, &gen);
    y.backward(g);
    Tensor expected = matmul(g.to(kBFloat16).to(kFloat64).t(), x.to(kBFloat16).to(kFloat64));
    CHECK(allclose(w2.grad().to(kFloat64), expected, 1e-2, 1e-2));
  }

  TEST_CASE("autocast refuses integer operands of low-precision ops and non-reduced dtypes") {
    CHECK_WEAVE_ERROR(AutocastGuard(kInt32), "autocast", "expected kBFloat16 or kFloat16");
    CHECK_WEAVE_ERROR(AutocastGuard(kFloat32), "autocast", "found float32");
    AutocastGuard autocast(kBFloat16);
    Tensor ints = ones({2, 3}, {.dtype = kInt64});
    CHECK_WEAVE_ERROR(matmul(ints, ints.t()), "matmul", "expected a floating lhs, found int64");
    CHECK_WEAVE_ERROR(linear(randn({2, 3}), ints), "linear", "floating weight, found int64");
    CHECK(sum(ints).dtype() == kInt64);  // float32 ops leave integers alone
  }

  TEST_CASE(
      "Adam and SGD on bfloat16 parameters keep float32 state; MixedPrecision keeps small "
      "updates") {
    Generator gen(9);
    for (int which = 0; which < 2; ++which) {
      CAPTURE(which);
      Tensor p = randn({300}, {}, &gen).to(kBFloat16).requires_grad_();
      Tensor p32 = p.detach().to(kFloat32).requires_grad_();
      std::unique_ptr<optim::Optimizer> low, wide;
      if (which == 0) {
        low =
            std::make_unique<optim::AdamW>(std::vector<Tensor>{p}, optim::AdamWOptions{.lr = 0.01});
        wide = std::make_unique<optim::AdamW>(std::vector<Tensor>{p32},
                                              optim::AdamWOptions{.lr = 0.01});
      } else {
        low = std::make_unique<optim::SGD>(std::vector<Tensor>{p},
                                           optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
        wide = std::make_unique<optim::SGD>(std::vector<Tensor>{p32},
                                            optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
      }
      for (int step = 0; step < 5; ++step) {
        Tensor g = randn({300}, {}, &gen).to(kBFloat16);
        p.set_grad(g);
        p32.set_grad(g.to(kFloat32));
        low->step();
        wide->step();
        for (const Tensor& s : low->state()) CHECK(s.dtype() == kFloat32);
        // the same float32 arithmetic, the parameter rounded once per step: bitwise equal
        CHECK(equal(p.detach(), p32.detach().to(kBFloat16)));
        NoGradGuard no_grad;
        p32.copy_(p.detach().to(kFloat32));  // the float32 run continues from the rounded value
      }
    }
    // lr 1e-4 against weight 1: each update is below half a bfloat16 ulp (2^-8)
    Tensor plain = ones({4}, {.dtype = kBFloat16}).requires_grad_();
    Tensor mixed = ones({4}, {.dtype = kBFloat16}).requires_grad_();
    optim::SGD sgd({plain}, {.lr = 1e-4});
    optim::MixedPrecision mp({mixed}, [](std::vector<Tensor> masters) {
      return std::make_unique<optim::SGD>(std::move(masters), optim::SGDOptions{.lr = 1e-4});
    });
    CHECK(mp.master(0).dtype() == kFloat32);
    for (int step = 0; step < 100; ++step) {
      plain.set_grad(ones({4}, {.dtype = kBFloat16}));
      mixed.set_grad(ones({4}, {.dtype = kBFloat16}));
      sgd.step();
      mp.step();
    }
    CHECK(plain.detach().to(kFloat32).data<float>()[0] == 1.0f);  // every update lost
    CHECK(mp.master(0).data<float>()[0] == doctest::Approx(0.99).epsilon(1e-5));
    CHECK(mixed.detach().to(kFloat32).data<float>()[0] == float(BFloat16(0.99f)));

    // the masters and the wrapped state round-trip through a state dict
    optim::MixedPrecision restored(
        {ones({4}, {.dtype = kBFloat16}).requires_grad_()}, [](std::vector<Tensor> masters) {
          return std::make_unique<optim::SGD>(std::move(masters), optim::SGDOptions{.lr = 1e-4});
        });
    restored.load_state_dict(mp.state_dict());
    CHECK(equal(restored.master(0), mp.master(0)));
    CHECK(equal(restored.params()[0].detach(), mixed.detach()));
  }

  TEST_CASE("float16 and bfloat16 means, variances and losses sum and divide in float32") {
    Generator g(5);
    for (DType dtype : {kFloat16, kBFloat16}) {
      CAPTURE(dtype);
      // Within one rounding to dtype (plus float32 accumulation) of the float64 result on the
      // same rounded values.
      auto check_close = [&](const Tensor& got, const Tensor& want) {
        REQUIRE(got.dtype() == dtype);
        const double a = got.to(kFloat64).item<double>(), b = want.item<double>();
        CHECK_MESSAGE(std::abs(a - b) <= (2 * unit_roundoff(dtype) + 1e-5) * std::abs(b), a, " vs ",
                      b);
      };
      // Sums past float16's largest value (65504): 70,000 ones, 66,000 times 1000.
      check_close(mean(ones({70000}, {.dtype = dtype})), full({}, 1.0, {.dtype = kFloat64}));
      Tensor thousands = full({66, 1000}, 1000.0, {.dtype = dtype});
      check_close(mean(thousands), full({}, 1000.0, {.dtype = kFloat64}));
      Tensor row_means = mean(thousands, {1});
      CHECK(row_means.dtype() == dtype);
      CHECK(equal(row_means.to(kFloat64), full({66}, 1000.0, {.dtype = kFloat64})));
      // Squares past it: values near 200 (a variance of 40,000).
      Tensor wide = (randn({70000}, {.dtype = kFloat64}, &g) * 200.0).to(dtype);
      check_close(var(wide), var(wide.to(kFloat64)));
      // Losses over 65,536 rows, and one whose differences square past float16's range.
      Tensor a = (randn({65536, 4}, {.dtype = kFloat64}, &g) * 100.0).to(dtype);
      Tensor b = randn({65536, 4}, {.dtype = kFloat64}, &g).to(dtype);
      check_close(mse_loss(a, b), mse_loss(a.to(kFloat64), b.to(kFloat64)));
      Tensor logits = (randn({65536, 10}, {.dtype = kFloat64}, &g) * 3.0).to(dtype);
      Tensor target = randint(0, 10, {65536}, {.dtype = kInt64}, &g);
      Tensor leaf = logits.detach().requires_grad_();
      Tensor loss = cross_entropy(leaf, target);
      check_close(loss, cross_entropy(logits.to(kFloat64), target));
      loss.backward();
      REQUIRE(leaf.grad().dtype() == dtype);
      CHECK(all_finite(std::vector<Tensor>{leaf.grad()}));
      CHECK(cross_entropy(logits, target, Reduction::None).dtype() == dtype);
    }
  }

  TEST_CASE("all_finite over a list: one verdict, overflowing sums of finite values included") {
    Tensor big = full({2}, 3e38), small = ones({3}, {.dtype = kBFloat16});
    CHECK(all_finite(std::vector<Tensor>{big, Tensor(), small}));  // big's own sum overflows
    CHECK(all_finite(std::vector<Tensor>{}));
    for (double bad : {double(INFINITY), -double(INFINITY), double(NAN)}) {
      CAPTURE(bad);
      Tensor last = ones({4});
      last.data<float>()[3] = float(bad);
      CHECK(!all_finite(std::vector<Tensor>{big, small, last}));
    }
  }

  TEST_CASE("GradScaler: the documented scale sequence, skipped steps, and misuse") {
    Tensor w = ones({3}).requires_grad_();
    optim::SGD opt({w}, {.lr = 0.1});
    parallel::GradScaler scaler;
    CHECK(scaler.get_scale() == 65536.0);
    auto clean_step = [&] {
      opt.zero_grad();
      scaler.scale(sum(w * 2.0)).backward();
      const bool stepped = scaler.step(opt);
      scaler.update();
      return stepped;
    };
    for (int step = 1; step <= 4100; ++step) {
      REQUIRE(clean_step());
      // x2 after every 2000 clean steps
      const double expected = 65536.0 * std::pow(2.0, double(step / 2000));
      if (scaler.get_scale() != expected) {
        FAIL_CHECK("step ", step, ": scale ", scaler.get_scale(), ", expected ", expected);
        break;
      }
    }
    CHECK(scaler.get_scale() == 262144.0);
    CHECK(scaler.growth_tracker() == 100);
    // the unscaled gradient is exact (a power of two scale): w moved by 0.1 * 2 per step
    CHECK(w.detach().data<float>()[0] == doctest::Approx(1.0 - 4100 * 0.2).epsilon(1e-4));

    // an overflowing step: skipped, parameters bitwise unchanged, scale halved, tracker reset
    const Tensor before = w.detach().clone();
    opt.zero_grad();
    scaler.scale(sum(w * INFINITY)).backward();
    CHECK(!scaler.step(opt));
    scaler.update();
    CHECK(equal(w.detach(), before));
    CHECK(scaler.get_scale() == 131072.0);
    CHECK(scaler.growth_tracker() == 0);

    // unscale_ before clipping, then step without unscaling twice
    opt.zero_grad();
    scaler.scale(sum(w * 3.0)).backward();
    scaler.unscale_(opt.params());
    CHECK(w.grad().data<float>()[0] == 3.0f);
    CHECK_WEAVE_ERROR(scaler.unscale_(opt.params()), "GradScaler.unscale_", "already called");
    CHECK(scaler.step(opt));
    CHECK_WEAVE_ERROR(scaler.step(opt), "GradScaler.step", "already called");
    scaler.update();
    CHECK_WEAVE_ERROR(scaler.update(), "GradScaler.update", "no step since the last update()");

    // a scaler used without backward
    opt.zero_grad();
    CHECK_WEAVE_ERROR(scaler.step(opt), "GradScaler.unscale_", "no gradients to unscale");
    CHECK_WEAVE_ERROR(parallel::GradScaler({.init_scale = 0}), "GradScaler", "init_scale");
    CHECK_WEAVE_ERROR(scaler.load_state_dict({{"scale", -1.0}, {"growth_tracker", 0.0}}),
                      "GradScaler.load_state_dict", "finite scale > 0");
  }

  TEST_CASE("GradScaler: a run of skipped steps warns once, after warn_after_skipped of them") {
    Tensor w = ones({3}).requires_grad_();
    optim::SGD opt({w}, {.lr = 0.1});
    parallel::GradScaler scaler({.init_scale = 1024.0, .warn_after_skipped = 5});
    auto run_step = [&](double factor) {
      opt.zero_grad();
      scaler.scale(sum(w * factor)).backward();
      scaler.step(opt);
      scaler.update();
    };
    auto warnings = [](const std::string& text) {
      size_t n = 0;
      for (size_t at = text.find("steps were all skipped"); at != std::string::npos;
           at = text.find("steps were all skipped", at + 1))
        ++n;
      return n;
    };
    std::string printed = test::stderr_of([&] {
      for (int i = 0; i < 4; ++i) run_step(NAN);
    });
    CHECK(warnings(printed) == 0);  // 4 of 5: not yet
    printed = test::stderr_of([&] {
      for (int i = 0; i < 8; ++i) run_step(NAN);
    });
    CHECK_MESSAGE(warnings(printed) == 1, printed);
    CHECK_MESSAGE(printed.find("the last 5 steps were all skipped") != std::string::npos, printed);
    CHECK_MESSAGE(printed.find("from 1024 down to 64") != std::string::npos, printed);
    CHECK(scaler.skipped_in_a_row() == 12);
    run_step(1.0);  // a clean step ends the run; the next run warns again
    CHECK(scaler.skipped_in_a_row() == 0);
    printed = test::stderr_of([&] {
      for (int i = 0; i < 5; ++i) run_step(NAN);
    });
    CHECK_MESSAGE(warnings(printed) == 1, printed);
    parallel::GradScaler quiet({.warn_after_skipped = 0});
    opt.zero_grad();
    printed = test::stderr_of([&] {
      for (int i = 0; i < 200; ++i) {
        opt.zero_grad();
        quiet.scale(sum(w * NAN)).backward();
        quiet.step(opt);
        quiet.update();
      }
    });
    CHECK(warnings(printed) == 0);
  }
}

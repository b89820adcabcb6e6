#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "helpers.h"
#include "weave/kernels/functors.h"

using namespace weave;

namespace {
struct ScaledSquare : autograd::Function<ScaledSquare> {
  static constexpr const char* name = "ScaledSquareBackward";
  static Tensor forward(autograd::FunctionContext& ctx, const Tensor& x, double scale) {
    ctx.save_for_backward({x});
    ctx.data["scale"] = scale;
    return x * x * scale;
  }
  static std::vector<Tensor> backward(autograd::FunctionContext& ctx,
                                      const std::vector<Tensor>& g) {
    CHECK(ctx.needs_input_grad(0));
    double scale = std::any_cast<double>(ctx.data["scale"]);
    return {g[0] * ctx.saved()[0] * (2 * scale)};
  }
};

// Backward returns 2 g as a view: of a fresh buffer, or of `held` (a tensor someone else keeps).
struct ViewGradient : autograd::Function<ViewGradient> {
  static constexpr const char* name = "ViewGradientBackward";
  static inline Tensor held;
  static inline const void* returned = nullptr;
  static Tensor forward(autograd::FunctionContext&, const Tensor& x) { return x * 1.0; }
  static std::vector<Tensor> backward(autograd::FunctionContext&, const std::vector<Tensor>& g) {
    Tensor grad = held.defined() ? held.reshape({4}) : (g[0] * 2.0).reshape({2, 2}).reshape({4});
    returned = grad.data_ptr();
    return {grad};
  }
};
}  // namespace

TEST_SUITE("autograd") {
  TEST_CASE("nodes run in exact reverse creation order") {
    Tensor x = ones({2}).requires_grad_();
    std::vector<std::string> order;
    // Two branches created interleaved: a1, b1, a2, b2. Backward must run b2, a2, b1, a1.
    Tensor a1 = x * 2.0;
    Tensor b1 = x * 3.0;
    Tensor a2 = a1.exp();
    Tensor b2 = b1.exp();
    a1.register_hook([&](const Tensor&) {
      order.push_back("a1");
      return Tensor();
    });
    b1.register_hook([&](const Tensor&) {
      order.push_back("b1");
      return Tensor();
    });
    a2.register_hook([&](const Tensor&) {
      order.push_back("a2");
      return Tensor();
    });
    b2.register_hook([&](const Tensor&) {
      order.push_back("b2");
      return Tensor();
    });
    (a2 + b2).sum().backward();
    CHECK(order == std::vector<std::string>{"b2", "a2", "b1", "a1"});
  }

  TEST_CASE("gradients accumulate across uses and calls") {
    Tensor x = from_vector<double>({1, 2}).requires_grad_();
    Tensor y = (x * 2.0 + x * 3.0).sum();
    y.backward({}, true);
    CHECK(x.grad().to_vector<double>() == std::vector<double>{5, 5});
    y.backward();
    CHECK(x.grad().to_vector<double>() == std::vector<double>{10, 10});
    CHECK_WEAVE_ERROR(y.backward(), "autograd", "second time");
  }

  TEST_CASE("a leaf keeps a gradient nobody else sees, a view included, and copies a shared one") {
    // Copying every gradient costs a pass over it and, on a GPU, a launch per parameter.
    Tensor x = from_vector<double>({1, 2, 3, 4}).requires_grad_();
    ViewGradient::apply(x).sum().backward();
    CHECK(x.grad().data_ptr() == ViewGradient::returned);
    CHECK(x.grad().to_vector<double>() == std::vector<double>{2, 2, 2, 2});
    // A view of a tensor its function still holds is copied: accumulating into it would write
    // into that tensor.
    ViewGradient::held = full({2, 2}, 5.0, {.dtype = kFloat64});
    Tensor z = from_vector<double>({1, 2, 3, 4}).requires_grad_();
    ViewGradient::apply(z).sum().backward();
    CHECK(z.grad().data_ptr() != ViewGradient::returned);
    ViewGradient::apply(z).sum().backward();
    CHECK(z.grad().to_vector<double>() == std::vector<double>{10, 10, 10, 10});
    CHECK(ViewGradient::held.to_vector<double>() == std::vector<double>{5, 5, 5, 5});
    ViewGradient::held = {};
  }

  TEST_CASE("explicit output gradients and multiple roots") {
    Tensor x = from_vector<double>({1, 2, 3}).requires_grad_();
    Tensor y = x * x;
    y.backward(from_vector<double>({1, 0, 2}));
    CHECK(x.grad().to_vector<double>() == std::vector<double>{2, 0, 12});
    x.set_grad({});
    Tensor a = x.sum(), b = (x * 2.0).sum();
    autograd::backward({a, b});
    CHECK(x.grad().to_vector<double>() == std::vector<double>{3, 3, 3});
    CHECK_WEAVE_ERROR((x * 2.0).backward(), "backward", "one-element");
    CHECK_WEAVE_ERROR(ones({2}).sum().backward(), "backward", "does not require grad");
  }

  TEST_CASE("a saved tensor modified in place is an error naming node, shape and versions") {
    Tensor x = ones({2, 3}).requires_grad_();
    Tensor y = x * 2.0;
    Tensor z = y.exp();  // saves its output
    z.add_(1.0);
    std::string message;
    try {
      z.sum().backward();
    } catch (const Error& e) {
      message = e.what();
    }
    CHECK(message.find("[autograd]") == 0);
    CHECK(message.find("ExpBackward") != std::string::npos);
    CHECK(message.find("[2, 3]") != std::string::npos);
    CHECK(message.find("version 0") != std::string::npos);
    CHECK(message.find("version 1") != std::string::npos);
  }

  TEST_CASE("in-place ops on non-leaves keep correct gradients") {
    Tensor x = from_vector<double>({1, 2}).requires_grad_();
    Tensor y = x * 3.0;
    y.mul_(x);  // y = 3 x^2
    y.add_(x);  // y = 3 x^2 + x
    y.sum().backward();
    CHECK(x.grad().to_vector<double>() == std::vector<double>{7, 13});
    CHECK_WEAVE_ERROR(x.add_(1.0), "add_", "leaf");
    {
      NoGradGuard no_grad;
      x.add_(1.0);  // fine: how optimizers update parameters
    }
    CHECK(x.to_vector<double>() == std::vector<double>{2, 3});
  }

  TEST_CASE("hooks") {
    Tensor x = from_vector<double>({1, 2}).requires_grad_();
    auto handle = x.register_hook([](const Tensor& g) { return g * 10.0; });
    int post_calls = 0;
    x.register_post_accumulate_grad_hook([&](Tensor& leaf) {
      ++post_calls;
      CHECK(leaf.grad().defined());
    });
    std::vector<std::string> events;
    Tensor y = x * 2.0;
    y.register_hook([&](const Tensor& g) {
      events.push_back("hook");
      autograd::queue_callback([&] { events.push_back("end"); });
      return g;
    });
    y.sum().backward();
    CHECK(x.grad().to_vector<double>() == std::vector<double>{20, 20});
    CHECK(post_calls == 1);
    CHECK(events == std::vector<std::string>{"hook", "end"});
    handle.remove();
    x.set_grad({});
    (x * 2.0).sum().backward();
    CHECK(x.grad().to_vector<double>() == std::vector<double>{2, 2});
    CHECK_WEAVE_ERROR(autograd::queue_callback([] {}), "queue_callback", "no backward");
  }

  TEST_CASE("retain_grad keeps a non-leaf gradient") {
    Tensor x = from_vector<double>({1, 2}).requires_grad_();
    Tensor y = x * x;
    y.retain_grad();
    (y * 3.0).sum().backward();
    CHECK(y.grad().to_vector<double>() == std::vector<double>{3, 3});
  }

  TEST_CASE("an output dropped without backward is freed, with its node") {
    // Ops that save their own output must not keep it alive through the saved alias.
    manual_seed(0);
    Tensor x = (rand({3, 4}) + 0.5).requires_grad_();
    Tensor other = (rand({3, 4}) + 0.5).requires_grad_();
    std::vector<std::pair<std::string, std::function<Tensor()>>> ops = {
#define WEAVE_LEAK_CASE(Name, Functor, function) {#function, [&] { return function(x); }},
        WEAVE_UNARY_OPS(WEAVE_LEAK_CASE)
#undef WEAVE_LEAK_CASE
            {"pow", [&] { return pow(x, 2.5); }},
        {"pow(tensor)", [&] { return pow(x, other); }},
        {"maximum", [&] { return maximum(x, other); }},
        {"max", [&] { return max(x, {1}); }},
        {"min", [&] { return min(x); }},
        {"softmax", [&] { return softmax(x); }},
        {"log_softmax", [&] { return log_softmax(x); }},
        {"mul", [&] { return x * 2.0; }},
    };
    for (auto& entry : ops) {
      const std::string& name = entry.first;  // CAPTURE needs a variable, not a binding
      auto& op = entry.second;
      CAPTURE(name);
      std::weak_ptr<TensorImpl> output;
      std::weak_ptr<autograd::Node> node;
      {
        Tensor y = op();
        REQUIRE(y.grad_fn() != nullptr);
        output = y.impl_ptr();
        node = y.grad_fn();
      }
      CHECK(output.expired());
      CHECK(node.expired());
    }
  }

  TEST_CASE("no-grad mode and detach record nothing") {
    Tensor x = ones({2}).requires_grad_();
    {
      NoGradGuard no_grad;
      Tensor y = x * 2.0;
      CHECK_FALSE(y.requires_grad());
      CHECK(y.grad_fn() == nullptr);
      EnableGradGuard enable;
      CHECK((x * 2.0).requires_grad());
    }
    Tensor d = (x * 2.0).detach();
    CHECK_FALSE(d.requires_grad());
    CHECK(d.is_leaf());
    CHECK_FALSE((d * 3.0).requires_grad());
    CHECK_WEAVE_ERROR(ones({2}, {.dtype = kInt64}).requires_grad_(), "requires_grad_", "floating");
  }

  TEST_CASE("custom function") {
    Tensor x = from_vector<double>({1, -2}).requires_grad_();
    Tensor y = ScaledSquare::apply(x, 3.0);
    CHECK(y.grad_fn()->name() == "ScaledSquareBackward");
    y.sum().backward();
    CHECK(x.grad().to_vector<double>() == std::vector<double>{6, -12});
    auto result = autograd::gradcheck(
        [](const std::vector<Tensor>& in) { return ScaledSquare::apply(in[0], 0.5); },
        {randn({4}, {.dtype = kFloat64}).requires_grad_()});
    CHECK_MESSAGE(result.ok, result.report);
  }

  TEST_CASE("gradcheck refuses to check nothing") {
    // A backward that is plainly wrong: with nothing requiring grad it would never be compared.
    auto wrong = [](const std::vector<Tensor>& in) {
      return ScaledSquare::apply(in[0], 0.5) * 7.0;
    };
    CHECK_WEAVE_ERROR(autograd::gradcheck(wrong, {randn({4}, {.dtype = kFloat64})}), "gradcheck",
                      "nothing to check");
    CHECK_WEAVE_ERROR(
        autograd::gradcheck(wrong, {zeros({0}, {.dtype = kFloat64}).requires_grad_()}), "gradcheck",
        "nothing to check");
    CHECK_WEAVE_ERROR(autograd::gradcheck(wrong, {}), "gradcheck", "none of the 0 inputs");
    // One input requiring grad is enough: the others pass through unchecked.
    auto product = [](const std::vector<Tensor>& in) { return in[0] * in[1]; };
    auto result = autograd::gradcheck(product, {randn({3}, {.dtype = kFloat64}).requires_grad_(),
                                                randn({3}, {.dtype = kFloat64})});
    CHECK_MESSAGE(result.ok, result.report);
    CHECK(result.checked == 3);
  }

  TEST_CASE("gradients flow through a small network end to end") {
    Generator g(11);
    Tensor w1 = randn({8, 4}, {.dtype = kFloat64}, &g).requires_grad_();
    Tensor b1 = randn({8}, {.dtype = kFloat64}, &g).requires_grad_();
    Tensor w2 = randn({3, 8}, {.dtype = kFloat64}, &g).requires_grad_();
    Tensor x = randn({5, 4}, {.dtype = kFloat64}, &g);
    Tensor target = from_vector<int64_t>({0, 2, 1, 1, 0});
    auto result = autograd::gradcheck(
        [&](const std::vector<Tensor>& p) {
          return cross_entropy(linear(gelu(linear(x, p[0], p[1])), p[2]), target);
        },
        {w1, b1, w2});
    CHECK_MESSAGE(result.ok, result.report);
  }
}

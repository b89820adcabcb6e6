#include <cmath>
#include <limits>

#include "helpers.h"

using namespace weave;

TEST_SUITE("tensor") {
  TEST_CASE("views share storage and contiguous copies only when needed") {
    Tensor a = arange(12).reshape({3, 4});
    Tensor t = a.t();
    CHECK(t.storage() == a.storage());
    CHECK_FALSE(t.is_contiguous());
    CHECK(t.strides() == Strides{1, 4});
    CHECK(a.contiguous().is_same(a));
    Tensor c = t.contiguous();
    CHECK(c.storage() != a.storage());
    CHECK(c.to_vector<float>() == std::vector<float>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11});

    Tensor row = a.select(0, 1);
    row.fill_(-1);
    CHECK(a.to_vector<float>() == std::vector<float>{0, 1, 2, 3, -1, -1, -1, -1, 8, 9, 10, 11});
    Tensor column = a.narrow(1, 2, 1);
    column.mul_(10.0);
    CHECK(a.select(1, 2).to_vector<float>() == std::vector<float>{20, -10, 100});
    Tensor flat = a.reshape({12});
    CHECK(flat.storage() == a.storage());
    CHECK(t.reshape({12}).storage() != a.storage());  // not viewable: reshape copies
    CHECK_WEAVE_ERROR(t.view({12}), "view", "cannot be viewed");
    Tensor every_other = arange(10).slice(0, 1, 10, 3);
    CHECK(every_other.to_vector<int64_t>() == std::vector<int64_t>{1, 4, 7});
  }

  TEST_CASE("broadcasting follows NumPy") {
    Tensor col = from_vector<float>({1, 2, 3}, {3, 1});
    Tensor row = from_vector<float>({10, 20}, {1, 2});
    Tensor s = col + row;
    CHECK(s.shape() == Shape{3, 2});
    CHECK(s.to_vector<float>() == std::vector<float>{11, 21, 12, 22, 13, 23});
    CHECK((ones({2, 3, 4}) * arange(4)).sum().item() == doctest::Approx(2 * 3 * 6));
    CHECK(broadcast_shapes({5, 1, 4}, {3, 1}, "x") == Shape{5, 3, 4});
    CHECK_WEAVE_ERROR(ones({2, 3}) + ones({4}), "add", "cannot be broadcast");
    Tensor e = from_vector<float>({1, 2}).expand({3, 2});
    CHECK(e.strides() == Strides{0, 1});
    CHECK(e.sum({0}).to_vector<float>() == std::vector<float>{3, 6});
  }

  TEST_CASE("dtype promotion") {
    auto i32 = ones({2}, {.dtype = kInt32}), i64 = ones({2}, {.dtype = kInt64});
    auto f32 = ones({2}), f64 = ones({2}, {.dtype = kFloat64});
    auto f16 = ones({2}, {.dtype = kFloat16}), bf16 = ones({2}, {.dtype = kBFloat16});
    auto b = ones({2}, {.dtype = kBool}), u8 = ones({2}, {.dtype = kUInt8});
    CHECK((i32 + f32).dtype() == kFloat32);
    CHECK((i32 + i64).dtype() == kInt64);
    CHECK((f32 + f64).dtype() == kFloat64);
    CHECK((f16 + bf16).dtype() == kFloat32);
    CHECK((f16 + f16).dtype() == kFloat16);
    CHECK((b + u8).dtype() == kUInt8);
    CHECK((i32 * 0.5).dtype() == kFloat32);
    CHECK((i32 * 2.0).dtype() == kInt32);
    CHECK((f16 + 1.0).dtype() == kFloat16);
    CHECK((i32 / i32).dtype() == kFloat32);
    CHECK(exp(i64).dtype() == kFloat32);
    CHECK(sum(i32).dtype() == kInt64);
    CHECK(lt(i32, f32).dtype() == kBool);
    CHECK((f16 * 3.0).to_vector<float>() == std::vector<float>{3, 3});
  }

  TEST_CASE("16-bit float conversion") {
    auto roundtrip = [](float v) { return float(Half(v)); };
    CHECK(roundtrip(1.0f) == 1.0f);
    CHECK(roundtrip(-2.5f) == -2.5f);
    CHECK(roundtrip(65504.0f) == 65504.0f);
    CHECK(std::isinf(roundtrip(65520.0f)));
    CHECK(roundtrip(5.960464477539063e-08f) == 5.960464477539063e-08f);  // smallest subnormal
    CHECK(roundtrip(1.0f + 1.0f / 4096) == 1.0f);                        // ties to even
    CHECK(roundtrip(1.0f + 3.0f / 2048) == 1.0f + 2.0f / 1024);          // 1+1.5ulp -> 1+2ulp
    CHECK(std::isnan(roundtrip(std::numeric_limits<float>::quiet_NaN())));
    CHECK(float(BFloat16(1.0f)) == 1.0f);
    CHECK(float(BFloat16(3.140625f)) == 3.140625f);
    CHECK(float(BFloat16(1.0f + 1.0f / 256)) == 1.0f);  // tie to even
    CHECK(std::isnan(float(BFloat16(std::numeric_limits<float>::quiet_NaN()))));
    Tensor x = from_vector<float>({0.1f, 1000.5f, -3.0f});
    CHECK(allclose(x.to(kFloat16).to(kFloat32), x, 1e-3));
    CHECK(allclose(x.to(kBFloat16).to(kFloat32), x, 1e-2));
    CHECK(x.to(kInt64).to_vector<int64_t>() == std::vector<int64_t>{0, 1000, -3});
  }

  TEST_CASE("factories") {
    CHECK(arange(2, 8, 2).to_vector<float>() == std::vector<float>{2, 4, 6});
    CHECK(arange(5, {.dtype = kInt64}).dtype() == kInt64);
    CHECK(eye(2, 3).to_vector<float>() == std::vector<float>{1, 0, 0, 0, 1, 0});
    CHECK(full({2}, 7.5, {.dtype = kFloat64}).to_vector<double>() == std::vector<double>{7.5, 7.5});
    Generator g1(42), g2(42), g3(43);
    CHECK(equal(randn({5}, {}, &g1), randn({5}, {}, &g2)));
    CHECK_FALSE(equal(rand({5}, {}, &g1), rand({5}, {}, &g3)));
    manual_seed(9);
    Tensor first = rand({4});
    manual_seed(9);
    CHECK(equal(first, rand({4})));
    Tensor r = randint(-3, 4, {1000});
    CHECK(r.dtype() == kInt64);
    CHECK(min(r).item<int64_t>() == -3);
    CHECK(max(r).item<int64_t>() == 3);
    Tensor u = rand({10000});
    CHECK(mean(u).item() == doctest::Approx(0.5).epsilon(0.03));
    CHECK(var(randn({10000})).item() == doctest::Approx(1.0).epsilon(0.05));
    std::vector<float> buffer{1, 2, 3, 4};
    Tensor blob = from_blob(buffer.data(), {2, 2}, kFloat32);
    blob.mul_(2.0);
    CHECK(buffer == std::vector<float>{2, 4, 6, 8});
    CHECK(scalar_tensor(3).item() == 3);
    CHECK(from_vector<bool>({true, false}).dtype() == kBool);
  }

  TEST_CASE("printing shows values, shape, dtype and device") {
    std::string s = arange(4, {.dtype = kInt32}).reshape({2, 2}).str();
    CHECK(s.find("[[0, 1],") != std::string::npos);
    CHECK(s.find("shape=[2, 2]") != std::string::npos);
    CHECK(s.find("dtype=int32") != std::string::npos);
    CHECK(s.find("device=cpu") != std::string::npos);
    CHECK(from_vector<float>({1.5f}).str().find("1.5000") != std::string::npos);
    CHECK(arange(5000).str().find("...") != std::string::npos);
    Tensor x = ones({2}).requires_grad_();
    CHECK((x * 2.0).str().find("grad_fn=MulBackward") != std::string::npos);
    CHECK(Device("cuda:3").str() == "cuda:3");
    CHECK_WEAVE_ERROR(Device("tpu"), "device", "cannot parse");
  }

  TEST_CASE("reductions") {
    Tensor x = arange(24, {.dtype = kFloat64}).reshape({2, 3, 4});
    CHECK(x.sum({1}).to_vector<double>() == std::vector<double>{12, 15, 18, 21, 48, 51, 54, 57});
    CHECK(x.sum({0, 2}, true).shape() == Shape{1, 3, 1});
    CHECK(x.sum({0, 2}).to_vector<double>() == std::vector<double>{60, 92, 124});
    CHECK(x.mean().item() == doctest::Approx(11.5));
    CHECK(x.max({-1}).to_vector<double>() == std::vector<double>{3, 7, 11, 15, 19, 23});
    CHECK(x.min({0, 1}).to_vector<double>() == std::vector<double>{0, 1, 2, 3});
    Tensor y = from_vector<float>({3, 9, 9, 1, -5, 2}, {2, 3});
    CHECK(argmax(y, 1).to_vector<int64_t>() == std::vector<int64_t>{1, 2});
    CHECK(argmax(y).item<int64_t>() == 1);
    CHECK(argmin(y, 0, true).shape() == Shape{1, 3});
    CHECK(var(from_vector<double>({1, 2, 3, 4})).item() == doctest::Approx(5.0 / 3));
    CHECK(var(from_vector<double>({1, 2, 3, 4}), {}, 0).item() == doctest::Approx(1.25));
    float nan = std::numeric_limits<float>::quiet_NaN();
    CHECK(std::isnan(max(from_vector<float>({1, nan, 3})).item()));
    CHECK(sum(zeros({0, 3}), {0}).to_vector<float>() == std::vector<float>{0, 0, 0});
  }

  TEST_CASE("matmul matches a naive product") {
    Generator g(3);
    auto naive = [](const Tensor& a, const Tensor& b) {  // a [m, k], b [k, n]
      auto av = a.contiguous().to_vector<double>(), bv = b.contiguous().to_vector<double>();
      int64_t m = a.size(0), k = a.size(1), n = b.size(1);
      std::vector<double> out(m * n, 0.0);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j)
          for (int64_t p = 0; p < k; ++p) out[i * n + j] += av[i * k + p] * bv[p * n + j];
      return from_vector(out, {m, n});
    };
    Tensor a = randn({5, 7}, {.dtype = kFloat64}, &g), b = randn({7, 3}, {.dtype = kFloat64}, &g);
    CHECK(test::close(matmul(a, b), naive(a, b), 1e-12, 1e-12));
    Tensor at = randn({7, 5}, {.dtype = kFloat64}, &g).t(),
           bt = randn({3, 7}, {.dtype = kFloat64}, &g).t();
    CHECK(test::close(matmul(at, bt), naive(at, bt), 1e-12, 1e-12));
    CHECK(test::close(matmul(a, bt), naive(a, bt), 1e-12, 1e-12));
    Tensor batch = randn({2, 5, 7}, {.dtype = kFloat64}, &g);
    Tensor out = matmul(batch, b);
    CHECK(out.shape() == Shape{2, 5, 3});
    CHECK(test::close(out.select(0, 1), naive(batch.select(0, 1), b), 1e-12, 1e-12));
    Tensor single = randn({32, 64}, {}, &g), other = randn({64, 16}, {}, &g);
    CHECK(test::close(matmul(single, other), naive(single, other).to(kFloat32), 1e-4, 1e-4));
    CHECK_WEAVE_ERROR(matmul(ones({4, 6}), ones({5, 3})), "matmul",
                      "inner dimensions differ: lhs [4, 6] vs rhs [5, 3]");
  }

  TEST_CASE("shape ops") {
    Tensor x = arange(6).reshape({2, 3});
    CHECK(cat({x, x}, 1).shape() == Shape{2, 6});
    CHECK(stack({x, x}, 0).shape() == Shape{2, 2, 3});
    auto parts = split(arange(7), 3);
    REQUIRE(parts.size() == 3);
    CHECK(parts[2].to_vector<float>() == std::vector<float>{6});
    auto pieces = split(arange(7), std::vector<int64_t>{2, 5});
    CHECK(pieces[1].numel() == 5);
    CHECK(chunk(arange(6), 4).size() == 3);
    CHECK(x.unsqueeze(0).squeeze(0).shape() == Shape{2, 3});
    CHECK(x.permute({1, 0}).to_vector<float>() == std::vector<float>{0, 3, 1, 4, 2, 5});
    CHECK(index_select(x, 1, from_vector<int64_t>({2, 0})).to_vector<float>() ==
          std::vector<float>{2, 0, 5, 3});
    CHECK(where(gt(x, scalar_tensor(2)), x, zeros_like(x)).to_vector<float>() ==
          std::vector<float>{0, 0, 0, 3, 4, 5});
    CHECK(x.reshape({-1, 2}).shape() == Shape{3, 2});
    CHECK(x.flatten().shape() == Shape{6});
  }

  TEST_CASE("in-place ops bump the version counter") {
    Tensor x = zeros({3});
    uint64_t v = x.version();
    x.add_(1.0);
    CHECK(x.version() == v + 1);
    x.narrow(0, 0, 2).mul_(3.0);  // through a view: the shared counter moves
    CHECK(x.version() == v + 2);
    x.copy_(ones({3}));
    x.zero_();
    CHECK(x.version() == v + 4);
    CHECK(x.to_vector<float>() == std::vector<float>{0, 0, 0});
    Tensor y = ones({2, 2});
    y.add_(from_vector<float>({1, 2}), 2.0);
    CHECK(y.to_vector<float>() == std::vector<float>{3, 5, 3, 5});
    CHECK_WEAVE_ERROR(ones({2}).expand({3, 2}).add_(1.0), "add_", "broadcast view");
  }

  TEST_CASE(
      "addcmul_, addcdiv_ and lerp_ equal their expressions, in one pass or through autograd") {
    for (DType dtype : {kFloat32, kFloat64}) {
      CAPTURE(dtype);
      Generator g(9);
      Tensor start = randn({3, 4}, {.dtype = dtype}, &g), a = randn({3, 4}, {.dtype = dtype}, &g);
      Tensor b = rand({1, 4}, {.dtype = dtype}, &g) + 0.5;  // broadcast, away from zero
      const double tol = dtype == kFloat64 ? 1e-14 : 1e-6;
      Tensor x = start.clone();
      x.addcmul_(a, b, 0.3);
      CHECK(allclose(x, start + a * b * 0.3, tol, tol));
      x = start.clone();
      x.addcdiv_(a, b, -2.0);
      CHECK(allclose(x, start + a / b * -2.0, tol, tol));
      x = start.clone();
      x.lerp_(b, 0.25);
      CHECK(allclose(x, start + (b - start) * 0.25, tol, tol));
    }
    // with a graph: the gradients of the same expression
    Tensor w = randn({2, 3}, {.dtype = kFloat64}).requires_grad_();
    Tensor a = randn({2, 3}, {.dtype = kFloat64}).requires_grad_();
    Tensor b = randn({2, 3}, {.dtype = kFloat64});
    Tensor y = w * 1.0;
    y.addcmul_(a, b, 0.5);
    sum(y).backward();
    CHECK(allclose(w.grad(), ones({2, 3}, {.dtype = kFloat64}), 0, 0));
    CHECK(allclose(a.grad(), b * 0.5, 1e-15, 1e-15));
    Tensor ints = zeros({2}, {.dtype = kInt64});
    CHECK_THROWS_WITH_AS(ints.addcmul_(ints, ints), doctest::Contains("expected a floating tensor"),
                         Error);
  }

  TEST_CASE("PyTorch's method spellings equal the ops of their names") {
    Generator g(12);
    const Tensor x = randn({3, 4}, {.dtype = kFloat64}, &g);
    const Tensor positive = abs(x) + 0.5;
    for (auto [method, op] :
         std::vector<std::pair<Tensor, Tensor>>{{x.abs(), abs(x)},
                                                {x.neg(), neg(x)},
                                                {x.exp(), exp(x)},
                                                {positive.log(), log(positive)},
                                                {positive.sqrt(), sqrt(positive)},
                                                {positive.rsqrt(), rsqrt(positive)},
                                                {x.square(), square(x)},
                                                {x.sin(), sin(x)},
                                                {x.cos(), cos(x)},
                                                {x.tanh(), tanh(x)},
                                                {x.sigmoid(), sigmoid(x)},
                                                {x.relu(), relu(x)},
                                                {x.sign(), sign(x)},
                                                {x.clamp(-0.5, 0.5), clamp(x, -0.5, 0.5)},
                                                {x.softmax(1), softmax(x, 1)},
                                                {x.var({1}), var(x, {1})},
                                                {x.argmin(1), argmin(x, 1)},
                                                {x.argmax(), argmax(x)}})
      CHECK(equal(method, op));
    // and they record the same gradients
    Tensor leaf = x.clone().requires_grad_();
    leaf.abs().sum().backward();
    CHECK(equal(leaf.grad(), sign(x)));
  }
}

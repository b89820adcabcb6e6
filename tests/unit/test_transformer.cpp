// The transformer path: fused attention against the composed reference (float64), every fused
// kernel against its composition, masking and sampling ops against known values, memory of the
// fused attention, and bad arguments.
#include <cmath>
#include <map>
#include <set>

#include "helpers.h"
#include "weave/ops/attention_blocks.h"

using namespace weave;
using Inputs = std::vector<Tensor>;

using weave::test::relative_error;

namespace {

Tensor logical_or_diagonal(const Tensor& mask, int64_t tq, int64_t tk);

struct Reference {
  Tensor mask{};  // bool or additive, as passed to the fused op
  bool causal = false;
  double scale = 0;
  Tensor keep{};  // dropout's keep-mask, or undefined
  double p = 0;
};

// Attention composed from matmul, masks and softmax: the T x T scores held whole.
Tensor composed_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Reference& r) {
  const int64_t tq = q.size(2), tk = k.size(2);
  Tensor scores = matmul(q, k.transpose(-1, -2)) * r.scale;
  if (r.causal) {
    Tensor allowed = tril(ones({tq, tk}, {.dtype = kFloat64}), tk - tq);
    scores = masked_fill(scores, eq(allowed, zeros({}, {.dtype = kFloat64})), -INFINITY);
  }
  if (r.mask.defined()) {
    if (r.mask.dtype() == kBool)
      scores = masked_fill(scores, eq(r.mask, zeros({}, {.dtype = kBool})), -INFINITY);
    else
      scores = scores + r.mask;
  }
  Tensor probs = softmax(scores, -1);
  if (r.keep.defined()) probs = probs * r.keep.to(kFloat64) / (1.0 - r.p);
  return matmul(probs, v);
}

struct Case {
  std::string name;
  int64_t b, h, tq, tk, d, dv;
  bool causal = false;
  int mask = 0;  // 0 none, 1 bool, 2 additive, 3 additive that requires grad
  double p = 0;
  bool strided = false;  // q, k, v as [B, T, H, D] storage viewed [B, H, T, D]
};

void check_against_reference(const Case& c) {
  CAPTURE(c.name);
  Generator g(42);
  auto make = [&](int64_t t, int64_t d) {
    if (c.strided) return randn({c.b, t, c.h, d}, {.dtype = kFloat64}, &g).transpose(1, 2);
    return randn({c.b, c.h, t, d}, {.dtype = kFloat64}, &g);
  };
  Tensor q = make(c.tq, c.d), k = make(c.tk, c.d), v = make(c.tk, c.dv);
  if (c.strided) CHECK_FALSE(q.is_contiguous());
  Tensor mask;
  if (c.mask == 1) {
    mask = gt(rand({c.h, c.tq, c.tk}, {.dtype = kFloat64}, &g), scalar_tensor(0.3));
    // every row keeps its diagonal-ish key, so no row is empty (the reference would be NaN)
    mask = logical_or_diagonal(mask, c.tq, c.tk);
  } else if (c.mask >= 2) {
    mask = randn({c.tq, c.tk}, {.dtype = kFloat64}, &g);
  }
  std::vector<Tensor> leaves{q.detach().requires_grad_(), k.detach().requires_grad_(),
                             v.detach().requires_grad_()};
  std::vector<Tensor> ref_leaves{q.detach().requires_grad_(), k.detach().requires_grad_(),
                                 v.detach().requires_grad_()};
  Tensor mask_leaf, ref_mask_leaf;
  if (c.mask == 3) {
    mask_leaf = mask.detach().requires_grad_();
    ref_mask_leaf = mask.detach().requires_grad_();
  }
  Generator dropout(7), dropout_copy(7);
  AttentionOptions options{.causal = c.causal,
                           .mask = c.mask == 3 ? mask_leaf : mask,
                           .dropout_p = c.p,
                           .generator = &dropout};
  Tensor fused = scaled_dot_product_attention(leaves[0], leaves[1], leaves[2], options);
  Reference r{.mask = c.mask == 3 ? ref_mask_leaf : mask,
              .causal = c.causal,
              .scale = 1.0 / std::sqrt(double(c.d))};
  if (c.p > 0) {
    r.keep = attention_dropout_mask({c.b, c.h, c.tq, c.tk}, c.p, &dropout_copy);
    r.p = c.p;
  }
  Tensor expected = composed_attention(ref_leaves[0], ref_leaves[1], ref_leaves[2], r);
  CHECK(fused.shape() == expected.shape());
  CHECK(relative_error(fused, expected) <= 1e-10);
  Tensor probe = randn(expected.shape(), {.dtype = kFloat64}, &g);
  sum(fused * probe).backward();
  sum(expected * probe).backward();
  for (int i = 0; i < 3; ++i) {
    CAPTURE(i);
    REQUIRE(leaves[size_t(i)].grad().defined());
    CHECK(relative_error(leaves[size_t(i)].grad(), ref_leaves[size_t(i)].grad()) <= 1e-10);
  }
  if (c.mask == 3) CHECK(relative_error(mask_leaf.grad(), ref_mask_leaf.grad()) <= 1e-10);
}

// Marks (i, j) with j = i * tk / tq as allowed, so every query row attends to something.
Tensor logical_or_diagonal(const Tensor& mask, int64_t tq, int64_t tk) {
  std::vector<uint8_t> diagonal(size_t(tq * tk), 0);
  for (int64_t i = 0; i < tq; ++i) diagonal[size_t(i * tk + std::min(tk - 1, i * tk / tq))] = 1;
  Tensor extra = from_vector(diagonal, {tq, tk}).to(kBool);
  return where(extra, extra, mask);
}

}  // namespace

TEST_SUITE("transformer") {
  TEST_CASE("fused attention equals the composed reference, values and gradients (float64)") {
    // Blocks are 64 queries x 128 keys: lengths of 1, inside one block, and across blocks.
    for (const Case& c : std::vector<Case>{
             {"plain", 2, 3, 17, 17, 8, 8},
             {"causal", 2, 2, 70, 70, 16, 16, true},
             {"causal across key blocks", 1, 2, 150, 150, 13, 13, true},
             {"T = 1", 2, 2, 1, 1, 5, 5},
             {"T = 1, causal", 1, 1, 1, 1, 4, 4, true},
             {"Tq < Tk, causal (decoding)", 1, 2, 3, 131, 8, 8, true},
             {"Tq > Tk", 1, 2, 67, 9, 8, 6},
             {"single query over a cache", 2, 2, 1, 40, 8, 8, true},
             {"boolean mask", 2, 2, 66, 140, 7, 9, false, 1},
             {"additive mask + causal", 1, 3, 65, 65, 8, 8, true, 2},
             {"additive mask with gradient", 2, 2, 20, 30, 4, 4, false, 3},
             {"strided [B, T, H, D] views", 2, 3, 70, 70, 8, 8, true, 0, 0.0, true},
             {"dropout", 2, 2, 70, 130, 8, 8, false, 0, 0.25},
             {"dropout + causal + strided", 1, 2, 33, 33, 6, 6, true, 0, 0.5, true},
         })
      check_against_reference(c);
  }

  TEST_CASE("attention by blocks of heads (CUDA's float32/float64 path) equals the reference") {
    struct Everywhere {  // the blocked path on the CPU too, while the test runs
      explicit Everywhere(int64_t block_bytes) {
        detail::set_attention_by_blocks_everywhere(true, block_bytes);
      }
      ~Everywhere() { detail::set_attention_by_blocks_everywhere(false); }
    };
    Tensor q = zeros({1, 2, 3, 4}, {.dtype = kFloat64}),
           k = zeros({1, 2, 5, 4}, {.dtype = kFloat64});
    for (int64_t block_bytes : {int64_t(1), int64_t(0)}) {  // one head per block; the default
      CAPTURE(block_bytes);
      Everywhere on(block_bytes);
      REQUIRE(detail::attention_by_blocks(q, k, Tensor(), {.causal = true}));
      CHECK(!detail::attention_by_blocks(k, q, Tensor(), {.causal = true}));  // a row sees none
      for (const Case& c : std::vector<Case>{
               {"plain", 2, 3, 17, 17, 8, 8},
               {"causal", 2, 2, 70, 70, 16, 16, true},
               {"T = 1, causal", 1, 1, 1, 1, 4, 4, true},
               {"Tq < Tk, causal (decoding)", 1, 2, 3, 131, 8, 8, true},
               {"Tq > Tk", 1, 2, 67, 9, 8, 6},
               {"strided [B, T, H, D] views", 2, 3, 70, 70, 8, 8, true, 0, 0.0, true},
           })
        check_against_reference(c);
      Generator g(3);  // the log-sum-exp that ring attention merges by
      Tensor a = randn({1, 2, 5, 4}, {.dtype = kFloat64}, &g);
      Tensor b = randn({1, 2, 6, 4}, {.dtype = kFloat64}, &g);
      Tensor lse = log(sum(exp(matmul(a, b.transpose(-1, -2)) * 0.5), {-1}));
      CHECK(relative_error(scaled_dot_product_attention_with_lse(a, b, b).logsumexp, lse) <= 1e-12);
    }
    CHECK(!detail::attention_by_blocks(q, k, Tensor(), {}));  // off again: CPU uses the kernels
  }

  TEST_CASE("attention: the log-sum-exp, a row with nothing to attend to, and the output layout") {
    Generator g(3);
    Tensor q = randn({1, 2, 5, 4}, {.dtype = kFloat64}, &g),
           k = randn({1, 2, 6, 4}, {.dtype = kFloat64}, &g);
    Tensor v = randn({1, 2, 6, 4}, {.dtype = kFloat64}, &g);
    AttentionResult r = scaled_dot_product_attention_with_lse(q, k, v);
    Tensor scores = matmul(q, k.transpose(-1, -2)) * 0.5;
    Tensor lse = log(sum(exp(scores), {-1}));
    CHECK(relative_error(r.logsumexp, lse) <= 1e-12);
    // Memory is [B, T, H, D]: merging heads is a view.
    CHECK(r.output.transpose(1, 2).is_contiguous());
    // A boolean mask that hides every key from query 2: output 0, lse +inf, no NaN anywhere.
    Tensor allowed = ones({5, 6}, {.dtype = kBool});
    allowed = where(
        eq(arange(0, 5, 1, {.dtype = kInt64}).reshape({5, 1}), full({1, 6}, 2, {.dtype = kInt64})),
        zeros({}, {.dtype = kBool}), allowed);
    Tensor qg = q.detach().requires_grad_();
    AttentionResult masked = scaled_dot_product_attention_with_lse(qg, k, v, {.mask = allowed});
    CHECK(all_finite(masked.output));
    CHECK(max(abs(masked.output.select(2, 2))).item<double>() == 0.0);
    CHECK(std::isinf(masked.logsumexp.select(2, 2).select(1, 0).item<double>()));
    masked.output.sum().backward();
    CHECK(all_finite(qg.grad()));
    CHECK(max(abs(qg.grad().select(2, 2))).item<double>() == 0.0);
  }

  TEST_CASE("attention's gradients take their inputs' layout, so AccumulateGrad need not copy") {
    Generator g(5);
    // Contiguous [B, H, T, D] leaves: contiguous gradients, kept as .grad without a copy.
    Tensor q = randn({2, 3, 6, 4}, {.dtype = kFloat64}, &g).requires_grad_();
    Tensor k = randn({2, 3, 6, 4}, {.dtype = kFloat64}, &g).requires_grad_();
    Tensor v = randn({2, 3, 6, 4}, {.dtype = kFloat64}, &g).requires_grad_();
    std::vector<bool> contiguous;
    for (Tensor* t : {&q, &k, &v})
      t->register_hook([&contiguous](const Tensor& grad) {
        contiguous.push_back(grad.is_contiguous());
        return Tensor();
      });
    scaled_dot_product_attention(q, k, v, {.causal = true}).sum().backward();
    CHECK(contiguous == std::vector<bool>{true, true, true});
    // A [B, T, H, D] projection seen as [B, H, T, D]: heads-last gradients, the same strides.
    Tensor x = randn({2, 6, 3, 4}, {.dtype = kFloat64}, &g);
    Tensor heads = x.transpose(1, 2);
    const AttentionResult r = scaled_dot_product_attention_with_lse(heads, heads, heads);
    const AttentionGrads grads = scaled_dot_product_attention_backward(
        ones_like(r.output), heads, heads, heads, r.output, r.logsumexp);
    CHECK(grads.q.strides() == heads.strides());
    CHECK(grads.v.strides() == heads.strides());
    const AttentionGrads plain = scaled_dot_product_attention_backward(
        ones_like(r.output), q.detach(), k.detach(), v.detach(), r.output, r.logsumexp);
    CHECK(plain.k.is_contiguous());
  }

  TEST_CASE("attention's explicit backward equals autograd's, and refuses dropout") {
    Generator g(7);
    for (bool causal : {false, true})
      for (bool masked : {false, true})
        for (int64_t tq : {int64_t(5), int64_t(9)}) {
          CAPTURE(causal);
          CAPTURE(masked);
          CAPTURE(tq);
          Tensor q = randn({2, 3, tq, 4}, {.dtype = kFloat64}, &g).requires_grad_();
          Tensor k = randn({2, 3, 7, 4}, {.dtype = kFloat64}, &g).requires_grad_();
          Tensor v = randn({2, 3, 7, 5}, {.dtype = kFloat64}, &g).requires_grad_();
          const AttentionOptions options{
              .causal = causal,
              .mask =
                  masked ? gt(randn({tq, 7}, {.dtype = kFloat64}, &g), full({}, -0.5)) : Tensor(),
              .scale = 0.3};
          const AttentionResult r = scaled_dot_product_attention_with_lse(q, k, v, options);
          const Tensor grad = randn(r.output.shape(), {.dtype = kFloat64}, &g);
          r.output.backward(grad);
          const AttentionGrads explicit_grads = scaled_dot_product_attention_backward(
              grad, q.detach(), k.detach(), v.detach(), r.output.detach(), r.logsumexp, options);
          CHECK(relative_error(explicit_grads.q, q.grad()) <= 1e-12);
          CHECK(relative_error(explicit_grads.k, k.grad()) <= 1e-12);
          CHECK(relative_error(explicit_grads.v, v.grad()) <= 1e-12);
        }
    Tensor x = randn({1, 1, 3, 4}, {.dtype = kFloat64}, &g);
    CHECK_WEAVE_ERROR(
        scaled_dot_product_attention_backward(x, x, x, x, x, zeros({1, 1, 3}), {.dropout_p = 0.1}),
        "scaled_dot_product_attention_backward", "dropout");
    CHECK_WEAVE_ERROR(scaled_dot_product_attention_backward(x, x, x, x, x, zeros({1, 1, 4})),
                      "scaled_dot_product_attention_backward", "expected logsumexp of shape");
  }

  TEST_CASE("attention in float32 and bfloat16 follows float64") {
    Generator g(5);
    Tensor q = randn({2, 2, 40, 16}, {.dtype = kFloat64}, &g),
           k = randn({2, 2, 40, 16}, {.dtype = kFloat64}, &g);
    Tensor v = randn({2, 2, 40, 16}, {.dtype = kFloat64}, &g);
    Tensor exact = scaled_dot_product_attention(q, k, v, {.causal = true});
    Tensor f32 = scaled_dot_product_attention(q.to(kFloat32), k.to(kFloat32), v.to(kFloat32),
                                              {.causal = true});
    CHECK(f32.dtype() == kFloat32);
    CHECK(relative_error(f32, exact) < 1e-5);
    Tensor bf16 = scaled_dot_product_attention(q.to(kBFloat16), k.to(kBFloat16), v.to(kBFloat16),
                                               {.causal = true});
    CHECK(bf16.dtype() == kBFloat16);
    CHECK(relative_error(bf16, exact) < 3e-2);
  }

  TEST_CASE("fused attention's extra memory grows like T, the composed one's like T^2") {
    // T = 1024, 8 heads, head size 64 (float32): one score tensor is 32 MiB.
    const int64_t t = 1024, h = 8, d = 64;
    Generator g(1);
    Tensor q = randn({1, h, t, d}, {}, &g).requires_grad_();
    Tensor k = randn({1, h, t, d}, {}, &g).requires_grad_();
    Tensor v = randn({1, h, t, d}, {}, &g).requires_grad_();
    auto peak_extra = [&](const std::function<Tensor()>& attend) {
      for (const Tensor& x : {q, k, v}) x.grad() = Tensor();
      cpu_empty_cache();
      const size_t before = memory_stats().in_use;
      reset_peak_memory();
      attend().sum().backward();
      return double(memory_stats().peak - before);
    };
    const double fused =
        peak_extra([&] { return scaled_dot_product_attention(q, k, v, {.causal = true}); });
    const double composed = peak_extra([&] {
      Reference r{.causal = true, .scale = 1.0 / 8};
      return composed_attention(q, k, v, r);
    });
    const double io = 4.0 * t * h * d * 4;  // output + three gradients, float32
    const double scores = double(t) * t * h * 4;
    MESSAGE("fused extra " << fused / 1e6 << " MB, composed " << composed / 1e6
                           << " MB, one score tensor " << scores / 1e6 << " MB");
    CHECK(fused <= 1.5 * io);  // the output, the gradients and O(T) statistics
    CHECK(composed >= 2 * scores);
  }

  TEST_CASE("fused kernels equal their compositions (float64)") {
    Generator g(9);
    Tensor x = randn({6, 33}, {.dtype = kFloat64}, &g), w = randn({33}, {.dtype = kFloat64}, &g);
    Tensor b = randn({33}, {.dtype = kFloat64}, &g);
    // layer_norm: (x - mean) / sqrt(var + eps) w + b
    Tensor mu = mean(x, {1}, true), var_ = mean((x - mu) * (x - mu), {1}, true);
    CHECK(relative_error(layer_norm(x, {33}, w, b), (x - mu) / sqrt(var_ + 1e-5) * w + b) < 1e-12);
    // rms_norm: x / sqrt(mean(x^2) + eps) w
    CHECK(relative_error(rms_norm(x, {33}, w), x / sqrt(mean(x * x, {1}, true) + 1e-6) * w) <
          1e-12);
    // Gradients of the scale and shift alone (an input that does not require grad, such as
    // the data itself), against the composed ops' gradients.
    for (bool rms : {false, true}) {
      CAPTURE(rms);
      Tensor wf = w.detach().requires_grad_(), bf = b.detach().requires_grad_();
      Tensor wc = w.detach().requires_grad_(), bc = b.detach().requires_grad_();
      Tensor fused = rms ? rms_norm(x, {33}, wf) : layer_norm(x, {33}, wf, bf);
      Tensor composed = rms ? x / sqrt(mean(x * x, {1}, true) + 1e-6) * wc
                            : (x - mu) / sqrt(var_ + 1e-5) * wc + bc;
      Tensor probe = randn(x.shape(), {.dtype = kFloat64}, &g);
      sum(fused * probe).backward();
      sum(composed * probe).backward();
      CHECK(relative_error(wf.grad(), wc.grad()) < 1e-12);
      if (!rms) CHECK(relative_error(bf.grad(), bc.grad()) < 1e-12);
    }
    // bias_gelu: gelu(x + b), gelu_tanh's formula
    CHECK(relative_error(bias_gelu(x, b), gelu(x + b)) < 1e-14);
    CHECK(equal(bias_gelu(x, Tensor()), gelu(x)));
    CHECK(equal(bias_gelu(x, Tensor(), true), gelu_tanh(x)));
    Tensor z = x + b;
    Tensor tanh_form = 0.5 * z * (1.0 + tanh(std::sqrt(2 / M_PI) * (z + 0.044715 * z * z * z)));
    CHECK(relative_error(bias_gelu(x, b, true), tanh_form) < 1e-14);
    CHECK(relative_error(gelu_tanh(z), tanh_form) < 1e-14);
    // softmax / log_softmax along every dim of a 3-D tensor
    Tensor y = randn({3, 4, 5}, {.dtype = kFloat64}, &g);
    for (int d = 0; d < 3; ++d) {
      Tensor e = exp(y - max(y, {d}, true));
      CHECK(relative_error(softmax(y, d), e / sum(e, {d}, true)) < 1e-14);
      CHECK(relative_error(log_softmax(y, d), log(e / sum(e, {d}, true))) < 1e-13);
    }
    // cross_entropy over a large vocabulary, with ignored targets
    Tensor logits = randn({8, 5000}, {.dtype = kFloat64}, &g) * 3.0;
    Tensor target = from_vector<int64_t>({4999, 0, -100, 17, 2500, -100, 3, 3});
    Tensor picked = -log_softmax(logits, 1);
    double expected = 0;
    for (int64_t i : {0, 1, 3, 4, 6, 7})
      expected +=
          picked.select(0, i).select(0, target.to_vector<int64_t>()[size_t(i)]).item<double>();
    CHECK(std::abs(cross_entropy(logits, target).item<double>() - expected / 6) < 1e-12);
    CHECK(std::isnan(cross_entropy(logits.narrow(0, 2, 1), target.narrow(0, 2, 1)).item<double>()));
    CHECK(cross_entropy(logits, target, Reduction::None).select(0, 2).item<double>() == 0.0);
  }

  TEST_CASE("tril, triu and masked_fill against known values") {
    Tensor x = arange(1, 13, 1, {.dtype = kFloat64}).reshape({3, 4});
    CHECK(tril(x).to_vector<double>() == std::vector<double>{1, 0, 0, 0, 5, 6, 0, 0, 9, 10, 11, 0});
    CHECK(tril(x, 1).to_vector<double>() ==
          std::vector<double>{1, 2, 0, 0, 5, 6, 7, 0, 9, 10, 11, 12});
    CHECK(triu(x).to_vector<double>() == std::vector<double>{1, 2, 3, 4, 0, 6, 7, 8, 0, 0, 11, 12});
    CHECK(triu(x, -1).to_vector<double>() ==
          std::vector<double>{1, 2, 3, 4, 5, 6, 7, 8, 0, 10, 11, 12});
    CHECK(triu(x, 3).to_vector<double>() ==
          std::vector<double>{0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0});
    Tensor filled = masked_fill(x, gt(x, scalar_tensor(6.0, {.dtype = kFloat64})), -1.0);
    CHECK(filled.to_vector<double>() ==
          std::vector<double>{1, 2, 3, 4, 5, 6, -1, -1, -1, -1, -1, -1});
    CHECK_WEAVE_ERROR(tril(arange(0, 3, 1)), "tril", "at least 2 dims");
    CHECK_WEAVE_ERROR(masked_fill(x, x, 0.0), "masked_fill", "expected a bool mask");
    CHECK_WEAVE_ERROR(masked_fill(x, ones({2, 4}, {.dtype = kBool}), 0.0), "masked_fill",
                      "broadcast");
  }

  TEST_CASE("topk and multinomial") {
    Tensor x = from_vector<double>({3, 1, 4, 1, 5, 9, 2, 6, 5, 3}, {2, 5});
    TopK top = topk(x, 3);
    CHECK(top.values.to_vector<double>() == std::vector<double>{5, 4, 3, 9, 6, 5});
    CHECK(top.indices.to_vector<int64_t>() == std::vector<int64_t>{4, 2, 0, 0, 2, 3});
    TopK low = topk(x, 2, 1, false);  // ties: the lower index first
    CHECK(low.indices.to_vector<int64_t>() == std::vector<int64_t>{1, 3, 1, 4});
    TopK columns = topk(x, 1, 0);
    CHECK(columns.values.to_vector<double>() == std::vector<double>{9, 2, 6, 5, 5});
    CHECK(topk(from_vector<double>({1, NAN, 3}), 1).indices.item<int64_t>() == 1);
    CHECK_WEAVE_ERROR(topk(x, 6), "topk", "k = 6 is out of range");
    CHECK(argmax(x, 1).to_vector<int64_t>() == std::vector<int64_t>{4, 0});

    // Frequencies of 40000 draws match the normalized weights (a 5-sigma band each).
    Generator g(17);
    Tensor weights = from_vector<double>({1, 0, 3, 6});
    Tensor draws = multinomial(weights, 40000, true, &g);
    std::map<int64_t, int> counts;
    for (int64_t d : draws.to_vector<int64_t>()) ++counts[d];
    CHECK(counts[1] == 0);
    for (const auto& expected : {std::pair{0, 0.1}, std::pair{2, 0.3}, std::pair{3, 0.6}}) {
      const double p = expected.second, sigma = std::sqrt(40000 * p * (1 - p));
      CHECK(std::abs(counts[expected.first] - 40000 * p) < 5 * sigma);
    }
    Tensor rows = multinomial(from_vector<double>({1, 1, 1, 1, 0, 0, 5, 1}, {2, 4}), 2, false, &g);
    for (int r = 0; r < 2; ++r) {
      auto v = rows.select(0, r).to_vector<int64_t>();
      CHECK(v[0] != v[1]);
    }
    for (int64_t d : rows.select(0, 1).to_vector<int64_t>()) CHECK((d == 2 || d == 3));
    CHECK_WEAVE_ERROR(multinomial(from_vector<double>({0.5, -0.1}), 1), "multinomial",
                      "non-negative");
    CHECK_WEAVE_ERROR(multinomial(from_vector<double>({0.0, 0.0}), 1), "multinomial",
                      "no positive probability");
    CHECK_WEAVE_ERROR(multinomial(from_vector<double>({1.0, 0.0, 1.0}), 3), "multinomial",
                      "without replacement");
  }

  TEST_CASE("attention rejects bad arguments with clear errors") {
    Tensor q = randn({1, 2, 4, 8}), k = randn({1, 2, 5, 8}), v = randn({1, 2, 5, 8});
    const char* op = "scaled_dot_product_attention";
    CHECK_WEAVE_ERROR(scaled_dot_product_attention(q, k, randn({1, 2, 6, 8})), op,
                      "differ in length");
    CHECK_WEAVE_ERROR(scaled_dot_product_attention(q, randn({1, 2, 5, 4}), v), op,
                      "differ in head size");
    CHECK_WEAVE_ERROR(scaled_dot_product_attention(q, randn({1, 3, 5, 8}), v), op,
                      "k and v need one head count that divides q's");
    CHECK_WEAVE_ERROR(scaled_dot_product_attention(q, randn({2, 2, 5, 8}), v), op,
                      "differ in batch size");
    CHECK_WEAVE_ERROR(scaled_dot_product_attention(q.reshape({2, 4, 8}), k, v), op,
                      "expected q, k, v of shape [B, H, T, D]");
    CHECK_WEAVE_ERROR(
        scaled_dot_product_attention(q, k, v, {.mask = ones({4, 4}, {.dtype = kBool})}), op,
        "does not broadcast to the scores");
    CHECK_WEAVE_ERROR(
        scaled_dot_product_attention(q, k, v, {.mask = ones({4, 5}, {.dtype = kInt64})}), op,
        "expected a bool or floating mask");
    CHECK_WEAVE_ERROR(scaled_dot_product_attention(q.to(kFloat64), k, v), op, "one floating dtype");
    CHECK_WEAVE_ERROR(scaled_dot_product_attention(q, k, v, {.dropout_p = 1.0}), op, "dropout_p");
    CHECK_WEAVE_ERROR(rms_norm(q, {4}), "rms_norm", "does not end with normalized_shape");
    CHECK_WEAVE_ERROR(bias_gelu(q, randn({4})), "bias_gelu", "expected a bias of shape [8]");
    CHECK_WEAVE_ERROR(cross_entropy(randn({2, 3}), from_vector<int64_t>({0, 3})), "cross_entropy",
                      "target 3 at position 1");
  }
}

namespace {

// Multi-head self-attention from the module's weights, composed head by head from plain ops.
Tensor composed_self_attention(nn::MultiheadAttention& mha, const Tensor& x, bool causal) {
  const int64_t dim = x.size(2), heads = mha.heads(), hd = dim / heads;
  Tensor w = mha.qkv->weight, bias = mha.qkv->bias;
  std::vector<Tensor> outputs;
  for (int64_t h = 0; h < heads; ++h) {
    auto project = [&](int part) {
      Tensor wp = w.narrow(0, (3 * h + part) * hd, hd),
             bp = bias.narrow(0, (3 * h + part) * hd, hd);
      return matmul(x, wp.t()) + bp;  // [B, T, hd]
    };
    Reference r{.causal = causal, .scale = 1.0 / std::sqrt(double(hd))};
    outputs.push_back(composed_attention(project(0).unsqueeze(1), project(1).unsqueeze(1),
                                         project(2).unsqueeze(1), r)
                          .squeeze(1));
  }
  return matmul(cat(outputs, -1), mha.out->weight.t()) + mha.out->bias;
}

}  // namespace

TEST_SUITE("transformer") {
  TEST_CASE("linear on strided and permuted views multiplies them in place: no input copy") {
    Generator g(25);
    const Tensor base = randn({4, 9, 64}, {.dtype = kFloat64}, &g);  // [B, T, K]
    for (bool transposed : {true, false}) {
      CAPTURE(transposed);
      // [T, B, K] (leading dims out of memory order), or rows 64 apart holding 48 features
      auto view_of = [&](const Tensor& t) {
        return transposed ? t.transpose(0, 1) : t.narrow(2, 0, 48);
      };
      const int64_t k = view_of(base).size(2);
      const Tensor w = randn({32, k}, {.dtype = kFloat64}, &g),
                   b = randn({32}, {.dtype = kFloat64}, &g);
      Tensor leaf_w = w.clone().requires_grad_(), leaf_b = b.clone().requires_grad_();
      Tensor base_leaf = base.clone().requires_grad_();
      Tensor dense = view_of(base).contiguous().requires_grad_();
      Tensor view = view_of(base_leaf);
      const size_t before = memory_stats().in_use;
      reset_peak_memory();
      Tensor y = linear(view, leaf_w, leaf_b);
      // the output only: a copy of the input would add its 8 * numel bytes
      CHECK(memory_stats().peak - before <= size_t(y.numel()) * 8 + 1024);
      Tensor ref_w = w.clone().requires_grad_(), ref_b = b.clone().requires_grad_();
      Tensor expected = linear(dense, ref_w, ref_b);
      CHECK(y.shape() == expected.shape());
      CHECK(relative_error(y, expected) < 1e-13);
      const Tensor gy = randn(y.shape(), {.dtype = kFloat64}, &g);
      sum(y * gy).backward();
      sum(expected * gy).backward();
      CHECK(relative_error(view_of(base_leaf.grad()), dense.grad()) < 1e-13);
      CHECK(relative_error(leaf_w.grad(), ref_w.grad()) < 1e-13);
      CHECK(relative_error(leaf_b.grad(), ref_b.grad()) < 1e-13);
    }
  }

  TEST_CASE("MultiheadAttention equals attention composed head by head from its weights") {
    Generator g(21);
    nn::MultiheadAttention mha(12, 3, {.causal = true, .generator = &g});
    mha.to(kFloat64);
    Tensor x = randn({2, 7, 12}, {.dtype = kFloat64}, &g);
    CHECK(relative_error(mha(x), composed_self_attention(mha, x, true)) < 1e-12);
    CHECK_WEAVE_ERROR(nn::MultiheadAttention(10, 3), "MultiheadAttention", "multiple of heads");
    CHECK_WEAVE_ERROR(mha(randn({2, 7, 8}, {.dtype = kFloat64})), "MultiheadAttention",
                      "expected input [B, T, 12]");
  }

  TEST_CASE("TransformerBlock: gradients match finite differences; the KV cache decodes exactly") {
    Generator g(23);
    nn::TransformerBlock block(8, 2, {.hidden = 12, .generator = &g});
    block.to(kFloat64);
    Tensor x = randn({2, 5, 8}, {.dtype = kFloat64}, &g).requires_grad_();
    auto result = autograd::gradcheck([&](const Inputs& in) { return block(in[0]); }, {x});
    CHECK_MESSAGE(result.ok, result.report);
    // Every parameter's gradient too: gradcheck perturbs its inputs in place, so the block's
    // own parameters can be the inputs of a function that only runs the block.
    const Tensor fixed = x.detach();
    auto params =
        autograd::gradcheck([&](const Inputs&) { return block(fixed); }, block.parameters());
    CHECK_MESSAGE(params.ok, params.report);
    int64_t elements = 0;
    for (const Tensor& p : block.parameters()) elements += p.numel();
    CHECK(params.checked == elements);  // every element of every parameter was compared
    Tensor full = block(x);
    // Prompt of 3 positions, then 2 single positions through the cache: equal to the full run.
    NoGradGuard no_grad;
    nn::KVCache cache(5);
    Tensor xs = x.detach();
    Tensor first = block.forward(xs.narrow(1, 0, 3), cache);
    Tensor fourth = block.forward(xs.narrow(1, 3, 1), cache);
    Tensor fifth = block.forward(xs.narrow(1, 4, 1), cache);
    CHECK(cache.length() == 5);
    Tensor decoded = cat({first, fourth, fifth}, 1);
    CHECK(relative_error(decoded, full.detach()) < 1e-12);
    CHECK_WEAVE_ERROR(block.forward(xs.narrow(1, 0, 1), cache), "KVCache", "exceed max_length 5");
    cache.reset();
    CHECK_WEAVE_ERROR(block.forward(xs.narrow(0, 0, 1), cache), "KVCache",
                      "expected keys like the cached ones");
  }
}

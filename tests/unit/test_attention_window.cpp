// Sliding windows, soft-capped scores and placed queries (AttentionOptions::window, softcap,
// query_start) on every CPU attention path (the fused kernels, the blocked path CUDA's float32
// takes, the explicit backward ring attention uses), against attention composed from whole
// score matrices in float64: the window and the placement as an explicit boolean mask, the
// soft-cap as tanh.
#include <cmath>

#include "helpers.h"
#include "weave/models/llama/llama.h"
#include "weave/ops/attention_blocks.h"

using namespace weave;
using Inputs = std::vector<Tensor>;

using weave::test::relative_error;

namespace {

struct WindowCase {
  std::string name;
  int64_t b, h, kv_heads, tq, tk, d;
  int64_t window = 0;
  double softcap = 0;
  std::optional<int64_t> query_start{};
  bool documents = false;
};

/// Query i (at position start + i) sees key j iff j <= start + i and, with a window w,
/// j > start + i - w (and, packed, their documents agree): written out element by element.
Tensor visible(const WindowCase& c, const Tensor& doc_q, const Tensor& doc_k) {
  const int64_t start = c.query_start.value_or(c.tk - c.tq);
  std::vector<uint8_t> allowed(size_t(c.b * c.tq * c.tk), 0);
  const int64_t* query_doc = c.documents ? doc_q.data<int64_t>() : nullptr;
  const int64_t* key_doc = c.documents ? doc_k.data<int64_t>() : nullptr;
  for (int64_t b = 0; b < c.b; ++b)
    for (int64_t i = 0; i < c.tq; ++i)
      for (int64_t j = 0; j < c.tk; ++j) {
        const int64_t distance = start + i - j;
        bool sees = distance >= 0 && (c.window == 0 || distance < c.window);
        if (c.documents) sees = sees && query_doc[b * c.tq + i] == key_doc[b * c.tk + j];
        allowed[size_t((b * c.tq + i) * c.tk + j)] = sees;
      }
  return from_vector(allowed, {c.b, 1, c.tq, c.tk}).to(kBool);
}

/// softmax over the visible keys of softcap(scale q k^T) (0 for a row that sees none), then v.
Tensor composed(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& allowed,
                double softcap) {
  // Query head h reads key/value head h / group: each key/value head repeated group times.
  const int64_t group = q.size(1) / k.size(1);
  auto repeated = [&](const Tensor& t) {
    return t.unsqueeze(2)
        .expand({t.size(0), t.size(1), group, t.size(2), t.size(3)})
        .reshape({t.size(0), t.size(1) * group, t.size(2), t.size(3)});
  };
  Tensor kr = repeated(k), vr = repeated(v);
  Tensor scores = matmul(q, kr.transpose(-1, -2)) * (1.0 / std::sqrt(double(q.size(3))));
  if (softcap > 0) scores = tanh(scores * (1.0 / softcap)) * softcap;
  Tensor hidden = eq(allowed, zeros({}, {.dtype = kBool}));
  Tensor shifted = masked_fill(scores, hidden, -1e300);
  Tensor weights = masked_fill(exp(shifted - max(shifted, {-1}, true)), hidden, 0.0);
  Tensor total = sum(weights, {-1}, true);
  Tensor safe = where(gt(total, zeros({}, {.dtype = kFloat64})), total, ones_like(total));
  return matmul(weights / safe, vr);
}

void check_window_case(const WindowCase& c) {
  CAPTURE(c.name);
  Generator g(11);
  Tensor q = randn({c.b, c.h, c.tq, c.d}, {.dtype = kFloat64}, &g);
  Tensor k = randn({c.b, c.kv_heads, c.tk, c.d}, {.dtype = kFloat64}, &g) * 2.0;
  Tensor v = randn({c.b, c.kv_heads, c.tk, c.d}, {.dtype = kFloat64}, &g);
  Tensor doc_q, doc_k;
  AttentionOptions options{
      .causal = true, .window = c.window, .softcap = c.softcap, .query_start = c.query_start};
  if (c.documents) {  // documents of 1-9 positions, in order
    std::vector<int64_t> ids(size_t(c.b * c.tk));
    for (size_t e = 0; e < ids.size(); ++e) ids[e] = int64_t(e % size_t(c.tk)) / 9;
    doc_k = from_vector(ids, {c.b, c.tk});
    doc_q = doc_k.narrow(1, c.tk - c.tq, c.tq).contiguous();
    options.document_ids = doc_k;
  }
  const Tensor allowed = visible(c, doc_q, doc_k);
  Inputs leaves{q.detach().requires_grad_(), k.detach().requires_grad_(),
                v.detach().requires_grad_()};
  Inputs truth{q.detach().requires_grad_(), k.detach().requires_grad_(),
               v.detach().requires_grad_()};
  const AttentionResult fused =
      scaled_dot_product_attention_with_lse(leaves[0], leaves[1], leaves[2], options);
  const Tensor expected = composed(truth[0], truth[1], truth[2], allowed, c.softcap);
  CHECK(relative_error(fused.output, expected) <= 1e-10);
  Tensor probe = randn(expected.shape(), {.dtype = kFloat64}, &g);
  sum(fused.output * probe).backward();
  sum(expected * probe).backward();
  for (size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(relative_error(leaves[i].grad(), truth[i].grad()) <= 1e-10);
  }
  // The explicit backward (ring attention's blocks) takes the same options.
  if (!c.documents) {
    const AttentionGrads grads = scaled_dot_product_attention_backward(
        probe, q, k, v, fused.output.detach(), fused.logsumexp, options);
    CHECK(relative_error(grads.q, truth[0].grad()) <= 1e-10);
    CHECK(relative_error(grads.k, truth[1].grad()) <= 1e-10);
  }
}

const std::vector<WindowCase>& window_cases() {
  static const std::vector<WindowCase> cases{
      {"window 1 (each query sees itself)", 1, 2, 2, 9, 9, 4, 1},
      {"window inside a key block", 2, 2, 1, 70, 70, 8, 5},
      {"window across key blocks", 1, 2, 2, 200, 200, 8, 130},
      {"window longer than the sequence", 1, 1, 1, 20, 20, 4, 64},
      {"window, decoding against a longer cache", 1, 4, 2, 3, 150, 8, 16},
      {"soft-cap alone", 2, 2, 2, 33, 33, 8, 0, 1.5},
      {"soft-cap and window, grouped heads", 1, 4, 2, 70, 70, 8, 20, 2.0},
      {"queries placed after the keys (a later chunk)", 1, 2, 2, 16, 16, 4, 20, 0, 16},
      {"queries placed far after: beyond the window", 1, 2, 1, 8, 8, 4, 4, 0, 40},
      {"queries placed with rows that see nothing", 1, 2, 2, 16, 16, 4, 0, 0, -5},
      {"window with packed documents", 2, 2, 2, 150, 150, 8, 6, 0, {}, true},
      {"soft-cap, window, documents", 1, 2, 1, 70, 70, 8, 4, 3.0, {}, true},
  };
  return cases;
}

}  // namespace

TEST_SUITE("attention_window") {
  TEST_CASE("windows, soft-caps and placed queries equal the composed attention (float64)") {
    for (const WindowCase& c : window_cases()) check_window_case(c);
  }

  TEST_CASE("the blocked path (CUDA's float32) takes windows and soft-caps alike") {
    struct Everywhere {
      Everywhere() { detail::set_attention_by_blocks_everywhere(true, 4096); }
      ~Everywhere() { detail::set_attention_by_blocks_everywhere(false); }
    } on;
    const Tensor q = zeros({1, 2, 4, 4}, {.dtype = kFloat64});
    CHECK(detail::attention_by_blocks(q, q, Tensor(), {.causal = true, .window = 2}));
    // A row that sees no key (placed before every key) leaves the blocked path.
    CHECK(!detail::attention_by_blocks(q, q, Tensor(), {.causal = true, .query_start = -2}));
    CHECK(!detail::attention_by_blocks(q, q, Tensor(),
                                       {.causal = true, .query_start = 9, .window = 3}));
    for (const WindowCase& c : window_cases())
      if (c.kv_heads == c.h && !c.documents) check_window_case(c);
  }

  TEST_CASE("a window in float32 follows float64") {
    Generator g(5);
    Tensor q = randn({1, 2, 90, 16}, {}, &g), k = randn({1, 2, 90, 16}, {}, &g),
           v = randn({1, 2, 90, 16}, {}, &g);
    const AttentionOptions options{.causal = true, .window = 17, .softcap = 5.0};
    Tensor low = scaled_dot_product_attention(q, k, v, options);
    Tensor high =
        scaled_dot_product_attention(q.to(kFloat64), k.to(kFloat64), v.to(kFloat64), options);
    CHECK(relative_error(low, high) <= 1e-5);
  }

  TEST_CASE("a windowed key/value cache keeps window - 1 positions and decodes exactly") {
    Generator g(8);
    models::LlamaOptions options;
    options.vocab = 50, options.dim = 16, options.layers = 2, options.generator = &g;
    options.block.heads = 4, options.block.kv_heads = 2, options.block.window = 4;
    options.windowed_layers = {true, false};
    models::Llama model(options);
    const Tensor tokens = randint(0, 50, {2, 13}, {.dtype = kInt64}, &g);
    NoGradGuard no_grad;
    const Tensor whole = model(tokens);
    std::vector<nn::KVCache> caches = model.make_caches(13);
    std::vector<Tensor> steps{model.forward_cached(tokens.narrow(1, 0, 6), caches)};
    CHECK(caches[0].held() == 3);  // the windowed layer: window - 1
    CHECK(caches[1].held() == 6);  // the global one: every position
    for (int64_t t = 6; t < 13; ++t) {
      steps.push_back(model.forward_cached(tokens.narrow(1, t, 1), caches));
      CHECK(caches[0].held() == 3);
      CHECK(caches[0].length() == t + 1);
    }
    CHECK(relative_error(cat(steps, 1), whole) <= 1e-5);
    nn::KVCache cache(8);
    cache.append(zeros({1, 1, 2, 4}), zeros({1, 1, 2, 4}), 3);
    CHECK_THROWS_WITH_AS(cache.append(zeros({1, 1, 1, 4}), zeros({1, 1, 1, 4}), 0),
                         doctest::Contains("appended with window 0 after window 3"), Error);
  }

  TEST_CASE("windows and soft-caps refuse bad values by name") {
    Tensor q = zeros({1, 1, 4, 4});
    auto refuses = [&](const AttentionOptions& options, const char* part) {
      CHECK_THROWS_WITH_AS(scaled_dot_product_attention(q, q, q, options), doctest::Contains(part),
                           Error);
    };
    refuses({.window = 3}, "needs causal = true");
    refuses({.causal = true, .window = -1}, "window -1");
    refuses({.causal = true, .softcap = -2.0}, "softcap must be finite");
    refuses({.causal = true, .softcap = INFINITY}, "softcap must be finite");
  }
}

// The ops a Llama-class model adds to a GPT's, each against an independent truth in float64:
// rotary embeddings against the closed form written out element by element here, grouped-query
// attention against attention on key/value heads repeated for every query head, the gated MLPs
// against their activations composed from the plain ops, packed documents against attention
// run on each document alone, Llama blocks on a packed window against each document alone.
#include <array>
#include <cmath>
#include <numbers>
#include <vector>

#include "helpers.h"

using namespace weave;
using namespace weave::test;

namespace {

// x cos + rotate(x) sin, element by element: the textbook form, independent of the kernel.
// x is [B, T, H, D] contiguous float64; positions [B][T]; frequencies base^(-2i/R).
Tensor closed_form(const Tensor& x, const std::vector<std::vector<int64_t>>& positions, double base,
                   int64_t rotary_dim, bool interleaved) {
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3), half = rotary_dim / 2;
  std::vector<double> in = x.contiguous().to_vector<double>(), out = in;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const double* xi = in.data() + ((b * T + t) * H + h) * D;
        double* oi = out.data() + ((b * T + t) * H + h) * D;
        for (int64_t d = 0; d < rotary_dim; ++d) {
          // the pair index of dim d, and rotate(x)[d]
          const int64_t i = interleaved ? d / 2 : d % half;
          const double rotated = interleaved ? (d % 2 == 0 ? -xi[d + 1] : xi[d - 1])
                                             : (d < half ? -xi[d + half] : xi[d - half]);
          const double angle = double(positions[size_t(b)][size_t(t)]) *
                               std::pow(base, -2.0 * double(i) / double(rotary_dim));
          oi[d] = xi[d] * std::cos(angle) + rotated * std::sin(angle);
        }
      }
  return from_vector(out, x.shape());
}

// k [B, Hkv, T, D] with each head repeated for the `group` query heads that share it.
Tensor repeat_heads(const Tensor& k, int64_t group) {
  const Shape& s = k.shape();
  return k.unsqueeze(2)
      .expand({s[0], s[1], group, s[2], s[3]})
      .reshape({s[0], s[1] * group, s[2], s[3]});
}

Tensor positions_tensor(const std::vector<std::vector<int64_t>>& p) {
  std::vector<int64_t> flat;
  for (const auto& row : p) flat.insert(flat.end(), row.begin(), row.end());
  return from_vector(flat, {int64_t(p.size()), int64_t(p[0].size())});
}

}  // namespace

TEST_SUITE("llama_ops") {
  TEST_CASE("rotary embedding equals x cos + rotate(x) sin, in both layouts") {
    manual_seed(3);
    // Packed windows: positions restart per document; large positions test the angles' precision.
    const std::vector<std::vector<int64_t>> at = {{0, 1, 2, 0, 1, 2, 3},
                                                  {4000, 4001, 0, 9, 17, 1, 2}};
    Tensor x = randn({2, 7, 3, 8}, {.dtype = kFloat64});
    for (const bool interleaved : {false, true}) {
      CAPTURE(interleaved);
      for (const int64_t rotary_dim : {int64_t(8), int64_t(4)}) {  // whole heads, and partial
        CAPTURE(rotary_dim);
        const RotaryOptions options{.base = 500000,
                                    .interleaved = interleaved,
                                    .rotary_dim = rotary_dim == 8 ? 0 : rotary_dim};
        Tensor got = rotary_embedding(x, positions_tensor(at), options);
        CHECK(allclose(got, closed_form(x, at, 500000, rotary_dim, interleaved), 1e-12, 1e-12));
      }
      // Positions [T] are shared by the batch.
      Tensor shared = rotary_embedding(x, from_vector<int64_t>({0, 1, 2, 0, 1, 2, 3}, {7}),
                                       {.interleaved = interleaved});
      CHECK(allclose(shared, closed_form(x, {at[0], at[0]}, 10000, 8, interleaved), 1e-12, 1e-12));
    }
  }

  TEST_CASE("rotary embedding on a strided view, its gradient, and its dtypes") {
    manual_seed(4);
    // q of a fused projection [B, T, 3, H, D]: a strided view, turned without a copy of x.
    Tensor qkv = randn({2, 5, 3, 2, 6}, {.dtype = kFloat64});
    Tensor q = qkv.select(2, 0);
    CHECK_FALSE(q.is_contiguous());
    Tensor positions = from_vector<int64_t>({3, 1, 4, 1, 5}, {5});
    CHECK(allclose(rotary_embedding(q, positions), rotary_embedding(q.contiguous(), positions), 0,
                   0));
    for (const bool interleaved : {false, true}) {
      auto fn = [&](const std::vector<Tensor>& in) {
        return rotary_embedding(in[0].select(2, 1), positions,
                                {.interleaved = interleaved, .rotary_dim = 4});
      };
      CHECK(autograd::gradcheck(fn, {qkv.detach().requires_grad_(true)}).ok);
    }
    // The gradient of sum(y g) is g turned back: turning it forward again gives g.
    Tensor x = randn({1, 5, 2, 6}, {.dtype = kFloat64}).requires_grad_(true);
    Tensor y = rotary_embedding(x, positions);
    Tensor g = randn(y.shape(), {.dtype = kFloat64});
    (y * g).sum().backward();
    CHECK(allclose(rotary_embedding(x.grad(), positions), g, 1e-12, 1e-12));
    CHECK(allclose(sum(x.grad() * x.grad()), sum(g * g), 1e-12, 1e-12));  // a rotation keeps norms
    // bfloat16 in, bfloat16 out, computed in float32; the gradient reaches a bfloat16 leaf.
    Tensor xb = x.detach().to(kBFloat16).requires_grad_(true);
    Tensor yb = rotary_embedding(xb, positions);
    CHECK(yb.dtype() == kBFloat16);
    CHECK(allclose(yb.to(kFloat64), rotary_embedding(xb.to(kFloat64), positions), 1e-2, 1e-2));
    yb.sum().backward();
    CHECK(xb.grad().dtype() == kBFloat16);
  }

  TEST_CASE("rotary scores depend only on the distance between positions") {
    manual_seed(5);
    Tensor q = randn({1, 1, 1, 16}, {.dtype = kFloat64}),
           k = randn({1, 1, 1, 16}, {.dtype = kFloat64});
    auto score = [&](int64_t m, int64_t n) {
      Tensor qm = rotary_embedding(q, from_vector<int64_t>({m}, {1}));
      Tensor kn = rotary_embedding(k, from_vector<int64_t>({n}, {1}));
      return sum(qm * kn).item();
    };
    CHECK(score(7, 3) == doctest::Approx(score(104, 100)).epsilon(1e-12));
    CHECK(score(0, 0) == doctest::Approx(sum(q * k).item()).epsilon(1e-12));
  }

  TEST_CASE("Llama 3 frequency scaling") {
    const Llama3RopeScaling s{
        .factor = 8, .low_freq_factor = 1, .high_freq_factor = 4, .original_max_position = 8192};
    const int64_t dim = 128;
    const auto plain = rotary_frequencies(dim, {.base = 500000}).to_vector<double>();
    const auto scaled =
        rotary_frequencies(dim, {.base = 500000, .llama3_scaling = s}).to_vector<double>();
    REQUIRE(plain.size() == 64);
    int kept = 0, slowed = 0, blended = 0;
    for (size_t i = 0; i < plain.size(); ++i) {
      CHECK(plain[i] == doctest::Approx(std::pow(500000.0, -double(2 * i) / 128)).epsilon(1e-15));
      const double wavelength = 2 * std::numbers::pi / plain[i];
      if (wavelength < 8192 / 4.0) {
        CHECK(scaled[i] == plain[i]);
        ++kept;
      } else if (wavelength > 8192 / 1.0) {
        CHECK(scaled[i] == doctest::Approx(plain[i] / 8).epsilon(1e-15));
        ++slowed;
      } else {  // between: (1 - s) f / 8 + s f with s = (8192 / wavelength - 1) / (4 - 1)
        const double smooth = (8192 / wavelength - 1) / 3;
        CHECK(scaled[i] == doctest::Approx((1 - smooth) * plain[i] / 8 + smooth * plain[i]));
        CHECK(scaled[i] < plain[i]);
        CHECK(scaled[i] > plain[i] / 8);
        ++blended;
      }
    }
    CHECK(kept > 0);
    CHECK(slowed > 0);
    CHECK(blended > 0);
  }

  TEST_CASE("rotary embedding rejects what it cannot turn") {
    Tensor x = zeros({1, 3, 2, 6});
    Tensor p = from_vector<int64_t>({0, 1, 2}, {3});
    CHECK_WEAVE_ERROR(rotary_embedding(x, p, {.rotary_dim = 3}), "rotary_embedding", "even");
    CHECK_WEAVE_ERROR(rotary_embedding(x, p, {.rotary_dim = 8}), "rotary_embedding", "exceeds");
    CHECK_WEAVE_ERROR(rotary_embedding(x, from_vector<int64_t>({0, 1}, {2}), {}),
                      "rotary_embedding", "expected positions [3] or [1, 3]");
    CHECK_WEAVE_ERROR(rotary_embedding(x, p.to(kFloat32), {}), "rotary_embedding",
                      "int32 or int64");
    CHECK_WEAVE_ERROR(rotary_embedding(zeros({3, 2, 6}), p, {}), "rotary_embedding",
                      "[B, T, H, D]");
    CHECK_WEAVE_ERROR(
        rotary_embedding(
            x, p,
            {.llama3_scaling = Llama3RopeScaling{.low_freq_factor = 4, .high_freq_factor = 1}}),
        "rotary_embedding", "low_freq_factor < high_freq_factor");
  }

  TEST_CASE("grouped-query attention equals attention on repeated key/value heads") {
    manual_seed(6);
    const int64_t B = 2, H = 4, T = 70, D = 5;  // T spans the CPU kernel's query blocks
    for (const int64_t kv_heads : {int64_t(4), int64_t(2), int64_t(1)}) {
      for (const bool causal : {false, true}) {
        CAPTURE(kv_heads);
        CAPTURE(causal);
        // [B, T, H, D] storage seen as [B, H, T, D]: strided views, as a projection gives them.
        Tensor q = randn({B, T, H, D}, {.dtype = kFloat64}).transpose(1, 2).detach();
        Tensor k = randn({B, T, kv_heads, D}, {.dtype = kFloat64}).transpose(1, 2).detach();
        Tensor v = randn({B, kv_heads, T, D + 1}, {.dtype = kFloat64});
        Tensor g = randn({B, H, T, D + 1}, {.dtype = kFloat64});
        auto run = [&](bool grouped) {
          Tensor qi = q.detach().requires_grad_(true), ki = k.detach().requires_grad_(true),
                 vi = v.detach().requires_grad_(true);
          const int64_t group = H / kv_heads;
          Tensor y =
              grouped ? scaled_dot_product_attention(qi, ki, vi, {.causal = causal})
                      : scaled_dot_product_attention(qi, repeat_heads(ki, group),
                                                     repeat_heads(vi, group), {.causal = causal});
          (y * g).sum().backward();
          return std::vector<Tensor>{y, qi.grad(), ki.grad(), vi.grad()};
        };
        const auto grouped = run(true), repeated = run(false);
        for (size_t i = 0; i < grouped.size(); ++i) {
          CAPTURE(i);
          CHECK(allclose(grouped[i], repeated[i], 1e-12, 1e-12));
        }
      }
    }
    // One query head per key/value head of its own, with a boolean mask: the same rule.
    Tensor q = randn({1, 6, 9, 4}, {.dtype = kFloat64}),
           k = randn({1, 3, 9, 4}, {.dtype = kFloat64});
    Tensor v = randn({1, 3, 9, 4}, {.dtype = kFloat64});
    Tensor allowed = gt(randn({9, 9}), scalar_tensor(-0.5));
    CHECK(allclose(
        scaled_dot_product_attention(q, k, v, {.mask = allowed}),
        scaled_dot_product_attention(q, repeat_heads(k, 2), repeat_heads(v, 2), {.mask = allowed}),
        1e-12, 1e-12));
    CHECK_WEAVE_ERROR(scaled_dot_product_attention(q, randn({1, 4, 9, 4}), randn({1, 4, 9, 4})),
                      "scaled_dot_product_attention", "divides q's");
  }

  TEST_CASE("swiglu and geglu equal act(gate) * up, values and gradients") {
    manual_seed(7);
    Tensor gate_up = randn({3, 4, 10}, {.dtype = kFloat64});
    Tensor g = randn({3, 4, 5}, {.dtype = kFloat64});
    using Fused = Tensor (*)(const Tensor&);
    using Plain = Tensor (*)(const Tensor&);
    const std::vector<std::pair<Fused, Plain>> cases = {
        {[](const Tensor& x) { return swiglu(x); }, [](const Tensor& x) { return silu(x); }},
        {[](const Tensor& x) { return geglu(x); }, [](const Tensor& x) { return gelu(x); }},
        {[](const Tensor& x) { return geglu(x, true); },
         [](const Tensor& x) { return gelu_tanh(x); }}};
    for (const auto& [fused, plain] : cases) {
      Tensor a = gate_up.detach().requires_grad_(true), b = gate_up.detach().requires_grad_(true);
      Tensor y = fused(a);
      Tensor expected = plain(b.narrow(2, 0, 5)) * b.narrow(2, 5, 5);
      CHECK(allclose(y, expected, 1e-12, 1e-12));
      (y * g).sum().backward();
      (expected * g).sum().backward();
      CHECK(allclose(a.grad(), b.grad(), 1e-12, 1e-12));
    }
    CHECK_WEAVE_ERROR(swiglu(zeros({2, 5})), "swiglu", "expected gate_up [..., 2F]");
  }

  TEST_CASE("GatedMLP is down(silu(x Wg^T) * x Wu^T), initialized as one Linear(dim, 2 hidden)") {
    manual_seed(8);
    nn::GatedMLP mlp(6, 4, {.bias = true});
    CHECK(mlp.gate_up.shape() == Shape{2, 4, 6});
    CHECK(mlp.gate_up_bias.shape() == Shape{2, 4});
    mlp.to(kFloat64);
    Tensor x = randn({2, 3, 6}, {.dtype = kFloat64});
    Tensor gate = linear(x, mlp.gate_up.select(0, 0), mlp.gate_up_bias.select(0, 0));
    Tensor up = linear(x, mlp.gate_up.select(0, 1), mlp.gate_up_bias.select(0, 1));
    Tensor expected = linear(silu(gate) * up, mlp.down->weight, mlp.down->bias);
    Tensor y = mlp(x);
    CHECK(allclose(y, expected, 1e-12, 1e-12));
    // The same seed gives the same weights as one Linear(6, 8): each projection's fan-in is 6.
    manual_seed(8);
    nn::Linear fused(6, 8, true);
    CHECK(equal(mlp.gate_up.to(kFloat32).reshape({8, 6}),
                fused.weight));  // (float64 holds float32 exactly)
    auto fn = [&](const std::vector<Tensor>& in) { return mlp(in[0]); };
    CHECK(autograd::gradcheck(fn, {x.requires_grad_(true)}).ok);
  }

  TEST_CASE("attention over packed documents equals attention on each document alone") {
    manual_seed(9);
    // Documents crossing the CPU kernel's query (64) and key (128) blocks, one of length 1, and
    // a different packing per batch entry.
    const std::vector<std::vector<int64_t>> lengths = {{1, 70, 129, 100}, {200, 1, 99}};
    const int64_t T = 300, H = 4, D = 6;
    std::vector<int64_t> ids;
    for (const auto& row : lengths)
      for (size_t d = 0; d < row.size(); ++d) ids.insert(ids.end(), size_t(row[d]), int64_t(d));
    Tensor document_ids = from_vector(ids, {2, T});
    for (const int64_t kv_heads : {int64_t(4), int64_t(2)}) {
      for (const bool causal : {false, true}) {
        CAPTURE(kv_heads);
        CAPTURE(causal);
        Tensor q = randn({2, H, T, D}, {.dtype = kFloat64}).requires_grad_(true);
        Tensor k = randn({2, kv_heads, T, D}, {.dtype = kFloat64}).requires_grad_(true);
        Tensor v = randn({2, kv_heads, T, D}, {.dtype = kFloat64}).requires_grad_(true);
        Tensor g = randn({2, H, T, D}, {.dtype = kFloat64});
        Tensor y =
            scaled_dot_product_attention(q, k, v, {.causal = causal, .document_ids = document_ids});
        (y * g).sum().backward();
        // The reference: each document of each batch entry on its own, then the pieces put back.
        Tensor qr = q.detach().requires_grad_(true), kr = k.detach().requires_grad_(true),
               vr = v.detach().requires_grad_(true);
        std::vector<Tensor> rows;
        for (int64_t b = 0; b < 2; ++b) {
          std::vector<Tensor> pieces;
          int64_t start = 0;
          for (const int64_t length : lengths[size_t(b)]) {
            auto part = [&](const Tensor& t) { return t.narrow(0, b, 1).narrow(2, start, length); };
            pieces.push_back(
                scaled_dot_product_attention(part(qr), part(kr), part(vr), {.causal = causal}));
            start += length;
          }
          rows.push_back(cat(pieces, 2));
        }
        Tensor expected = cat(rows, 0);
        (expected * g).sum().backward();
        CHECK(allclose(y, expected, 1e-12, 1e-12));
        CHECK(allclose(q.grad(), qr.grad(), 1e-12, 1e-12));
        CHECK(allclose(k.grad(), kr.grad(), 1e-12, 1e-12));
        CHECK(allclose(v.grad(), vr.grad(), 1e-12, 1e-12));
      }
    }
    // Queries with documents of their own (a context-parallel block): ids [T] shared by the batch.
    Tensor q = randn({1, 2, 3, 4}, {.dtype = kFloat64}),
           k = randn({1, 2, 5, 4}, {.dtype = kFloat64});
    Tensor v = randn({1, 2, 5, 4}, {.dtype = kFloat64});
    Tensor y =
        scaled_dot_product_attention(q, k, v,
                                     {.document_ids = from_vector<int64_t>({0, 0, 1, 1, 1}, {5}),
                                      .query_document_ids = from_vector<int64_t>({1, 0, 2}, {3})});
    CHECK(allclose(
        y.select(2, 0),
        scaled_dot_product_attention(q.narrow(2, 0, 1), k.narrow(2, 2, 3), v.narrow(2, 2, 3))
            .select(2, 0),
        1e-12, 1e-12));
    CHECK(allclose(
        y.select(2, 1),
        scaled_dot_product_attention(q.narrow(2, 1, 1), k.narrow(2, 0, 2), v.narrow(2, 0, 2))
            .select(2, 0),
        1e-12, 1e-12));
    CHECK(equal(y.select(2, 2),
                zeros({1, 2, 4}, {.dtype = kFloat64})));  // a document with no keys here
    CHECK_WEAVE_ERROR(
        scaled_dot_product_attention(q, k, v, {.document_ids = from_vector<int64_t>({0, 1}, {2})}),
        "scaled_dot_product_attention", "expected document_ids [5] or [1, 5]");
    CHECK_WEAVE_ERROR(scaled_dot_product_attention(
                          q, k, v, {.query_document_ids = from_vector<int64_t>({0, 1, 1}, {3})}),
                      "scaled_dot_product_attention", "document_ids (the keys') is not");
  }

  TEST_CASE("attention over packed documents at T = 4096 allocates no T x T tensor") {
    manual_seed(10);
    const int64_t T = 4096, H = 2, D = 16;
    std::vector<int64_t> ids(static_cast<size_t>(T));
    for (int64_t i = 0; i < T; ++i) ids[size_t(i)] = i / 300;  // documents of 300 positions
    Tensor document_ids = from_vector(ids, {T});
    Tensor q = randn({1, H, T, D}).requires_grad_(true),
           k = randn({1, H, T, D}).requires_grad_(true);
    Tensor v = randn({1, H, T, D}).requires_grad_(true);
    const double inputs = double(3 * q.numel() * 4 + T * 8), output = double(q.numel() * 4);
    const size_t before = memory_stats().in_use;
    reset_peak_memory();
    Tensor y =
        scaled_dot_product_attention(q, k, v, {.causal = true, .document_ids = document_ids});
    const double forward_peak = double(memory_stats().peak - before);
    CHECK(forward_peak < 1.5 * (inputs + output));
    Tensor g = ones_like(y);
    const size_t before_backward = memory_stats().in_use;
    reset_peak_memory();
    y.backward(g);
    const double backward_peak = double(memory_stats().peak - before_backward);
    CHECK(backward_peak < 1.5 * (inputs + output));  // the gradients of q, k and v, and passes
    MESSAGE("peak above the inputs: forward ", forward_peak / 1e6, " MB, backward ",
            backward_peak / 1e6, " MB; inputs ", inputs / 1e6, " MB, output ", output / 1e6,
            " MB; one T x T float32 score matrix: ", double(T * T * 4) / 1e6, " MB");
  }

  // A packed window (positions restarting per document, document ids) through a Sequential of
  // two blocks, one of them under activation checkpointing and a hook: every document's
  // outputs, and the gradients, equal running each document alone through the same blocks.
  TEST_CASE("Llama blocks over a packed window equal the blocks on each document alone") {
    manual_seed(11);
    const models::LlamaBlockOptions options{
        .heads = 4, .kv_heads = 2, .hidden = 24, .rotary = RotaryOptions{.base = 1000}};
    auto first = std::make_shared<models::LlamaBlock>(16, options);
    auto second = std::make_shared<models::LlamaBlock>(16, options);
    nn::Sequential model{first, std::make_shared<nn::Checkpoint>(second)};
    model.to(kFloat64);
    int hook_calls = 0;
    auto handle = second->register_forward_pre_hook([&](nn::Module&, const Tensor& x) {
      CHECK(x.shape() == Shape{2, 8, 16});  // the main input; the side inputs pass by
      ++hook_calls;
      return Tensor();
    });
    const Tensor x = randn({2, 8, 16}, {.dtype = kFloat64}),
                 w = randn({2, 8, 16}, {.dtype = kFloat64});
    // Row 0 packs documents of 3 and 5 positions; row 1 is one document of 8.
    const Tensor positions =
        from_vector<int64_t>({0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7}, {2, 8});
    const Tensor documents =
        from_vector<int64_t>({0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0}, {2, 8});
    Tensor packed_x = x.detach().requires_grad_(true);
    Tensor y = model({packed_x, positions, documents});
    (y * w).sum().backward();
    CHECK(hook_calls == 2);  // the forward, and the checkpoint's recomputation in backward
    handle.remove();
    std::vector<Tensor> packed_grads;
    for (const Tensor& p : model.parameters()) packed_grads.push_back(p.grad().clone());
    model.zero_grad();
    // Each document alone: positions 0 .. L-1 by default, one document.
    Tensor alone_x = x.detach().requires_grad_(true);
    const std::vector<std::array<int64_t, 3>> pieces = {{0, 0, 3}, {0, 3, 5}, {1, 0, 8}};
    for (const std::array<int64_t, 3>& at : pieces) {  // row, start, length
      auto piece = [&](const Tensor& t) { return t.narrow(0, at[0], 1).narrow(1, at[1], at[2]); };
      Tensor yp = model(piece(alone_x));
      CHECK(allclose(piece(y.detach()), yp, 1e-12, 1e-12));
      (yp * piece(w)).sum().backward();
    }
    CHECK(allclose(packed_x.grad(), alone_x.grad(), 1e-12, 1e-12));
    const auto params = model.parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      CAPTURE(i);
      CHECK(allclose(packed_grads[i], params[i].grad(), 1e-11, 1e-12));
    }
  }

  TEST_CASE("head_dim apart from dim / heads, q/k norms and a scale: the composed ops' result") {
    manual_seed(17);
    const int64_t B = 2, T = 7, dim = 12, heads = 4, kv_heads = 2, head_dim = 6;
    for (const bool unit_offset : {false, true}) {
      CAPTURE(unit_offset);
      nn::GroupedQueryAttention attention(
          dim, {.heads = heads,
                .head_dim = head_dim,
                .kv_heads = kv_heads,
                .qk_norm = nn::HeadNormOptions{.eps = 1e-5, .unit_offset = unit_offset},
                .scale = 0.37,
                .rotary = RotaryOptions{.base = 1000}});
      attention.to(kFloat64);
      CHECK(attention.q->weight.shape() == Shape{heads * head_dim, dim});
      CHECK(attention.out->weight.shape() == Shape{dim, heads * head_dim});
      CHECK(attention.q_norm.shape() == Shape{head_dim});
      {
        NoGradGuard no_grad;  // norms away from their start, so dropping one would show
        attention.q_norm.copy_(randn({head_dim}, {.dtype = kFloat64}));
        attention.k_norm.copy_(randn({head_dim}, {.dtype = kFloat64}));
      }
      const Tensor x = randn({B, T, dim}, {.dtype = kFloat64});
      const Tensor y = attention(x);
      // The same from the ops, written out.
      const Tensor positions = position_ids(0, T, x.device());
      const auto norm = [&](const Tensor& t, const Tensor& w) {
        return rms_norm(t, {head_dim}, unit_offset ? w + 1.0 : w, 1e-5);
      };
      const Tensor kv = attention.kv;
      Tensor q = linear(x, attention.q->weight).reshape({B, T, heads, head_dim});
      Tensor k = linear(x, kv.select(0, 0)).reshape({B, T, kv_heads, head_dim});
      Tensor v = linear(x, kv.select(0, 1)).reshape({B, T, kv_heads, head_dim});
      q = rotary_embedding(norm(q, attention.q_norm), positions, {.base = 1000});
      k = rotary_embedding(norm(k, attention.k_norm), positions, {.base = 1000});
      const Tensor a = scaled_dot_product_attention(
          q.transpose(1, 2), repeat_heads(k.transpose(1, 2), 2), repeat_heads(v.transpose(1, 2), 2),
          {.causal = true, .scale = 0.37});
      const Tensor want =
          linear(a.transpose(1, 2).reshape({B, T, heads * head_dim}), attention.out->weight);
      CHECK(allclose(y, want, 1e-12, 1e-12));
      // Decoding one position at a time with a cache gives the same outputs.
      NoGradGuard no_grad;
      nn::KVCache cache(T);
      for (int64_t t = 0; t < T; ++t)
        CHECK(allclose(attention.forward(nn::Inputs(x.narrow(1, t, 1)), cache), y.narrow(1, t, 1),
                       1e-12, 1e-12));
    }
    CHECK_WEAVE_ERROR(nn::GroupedQueryAttention(10, {.heads = 4}), "GroupedQueryAttention",
                      "multiple of heads 4");
    CHECK_WEAVE_ERROR(nn::GroupedQueryAttention(10, {.heads = 4, .head_dim = 3, .scale = -1.0}),
                      "GroupedQueryAttention", "scale must be positive");
    CHECK_WEAVE_ERROR(nn::GroupedQueryAttention(10, {.heads = 4, .head_dim = 3}),
                      "GroupedQueryAttention", "head_dim 3 must be even");
    CHECK(nn::GroupedQueryAttention(10, {.heads = 4, .head_dim = 3, .rotary = std::nullopt})
              .q->weight.shape() == Shape{12, 10});
  }

  TEST_CASE("grouped-query attention rejects head counts that do not group") {
    CHECK_WEAVE_ERROR(nn::GroupedQueryAttention(16, {.heads = 4, .kv_heads = 3}),
                      "GroupedQueryAttention", "must divide heads 4");
    nn::GroupedQueryAttention attention(16, {.heads = 4, .kv_heads = 1});
    CHECK(attention.kv.shape() == Shape{2, 4, 16});  // one key head and one value head of 4
    CHECK_WEAVE_ERROR(attention(zeros({2, 3, 8})), "GroupedQueryAttention",
                      "expected input [B, T, 16]");
  }

  TEST_CASE("a Llama model over a packed window equals it on each document; a tied head") {
    manual_seed(12);
    const models::LlamaOptions options{
        .vocab = 11, .dim = 16, .layers = 2, .block = {.heads = 4, .kv_heads = 2, .hidden = 24}};
    models::Llama model(options);
    model.to(kFloat64);
    const Tensor tokens = from_vector<int64_t>({3, 1, 4, 1, 5, 9, 2, 6, 5}, {1, 9});
    const Tensor positions = from_vector<int64_t>({0, 1, 2, 3, 0, 1, 2, 3, 4}, {9});
    const Tensor documents = from_vector<int64_t>({0, 0, 0, 0, 1, 1, 1, 1, 1}, {9});
    const Tensor logits = model({tokens, positions, documents});
    CHECK(logits.shape() == Shape{1, 9, 11});
    CHECK(allclose(logits.narrow(1, 0, 4), model(tokens.narrow(1, 0, 4)), 1e-12, 1e-12));
    CHECK(allclose(logits.narrow(1, 4, 5), model(tokens.narrow(1, 4, 5)), 1e-12, 1e-12));
    models::LlamaOptions tied_options = options;
    tied_options.tie_embeddings = true;
    models::Llama tied(tied_options);
    tied.to(kFloat64);
    CHECK(tied.head == nullptr);
    CHECK(tied.parameters().size() + 1 == model.parameters().size());
    const Tensor hidden = (*tied.norm)((*tied.blocks)((*tied.embedding)(tokens)));
    CHECK(allclose(tied(tokens), matmul(hidden, tied.embedding_weight().transpose(0, 1)), 1e-12,
                   1e-12));
  }

  TEST_CASE("a split the models cannot run raises, naming what and why") {
    const models::LlamaOptions llama{.vocab = 11, .dim = 16, .layers = 2, .block = {.heads = 4}};
    const models::GPT2Options gpt2{
        .vocab = 11, .dim = 16, .layers = 2, .heads = 4, .max_positions = 8};
    const Tensor tokens = from_vector<int64_t>({3, 1, 4}, {1, 3});
    // A pipeline stage holds some of the blocks: its caches cannot decode.
    models::Llama stage(llama, {.stage = 0, .stages = 2});
    CHECK(stage.blocks->size() == 1);
    CHECK(stage.norm == nullptr);
    std::vector<nn::KVCache> caches = stage.make_caches(8);
    CHECK_WEAVE_ERROR(stage.forward_cached(tokens, caches), "Llama",
                      "not split into pipeline stages");
    CHECK_WEAVE_ERROR(models::Llama(llama, {.stage = 2, .stages = 2}), "Llama",
                      "expected stage s of S stages");
    CHECK_WEAVE_ERROR(models::GPT2(gpt2, {.stages = 3}), "GPT2", "S <= layers (2)");
    // One cache per block.
    models::GPT2 whole(gpt2);
    std::vector<nn::KVCache> one(1, nn::KVCache(8));
    CHECK_WEAVE_ERROR(whole.forward_cached(tokens, one), "GPT2",
                      "expected a cache per block (2), found 1");
    models::Llama model(llama);
    CHECK_WEAVE_ERROR(model.forward_cached(tokens, one), "Llama",
                      "expected a cache per block (2), found 1");
    // GPT-2's blocks take experts without a tensor group (nn::TransformerBlock's own).
    models::GPT2Options with_experts = gpt2;
    with_experts.moe = nn::MoEOptions{.hidden = 16, .ffn = 8, .router = {.experts = 2}};
    models::GPT2 experts(with_experts);
    CHECK(experts(tokens).shape() == Shape{tokens.size(0), tokens.size(1), gpt2.vocab});
    CHECK(experts.aux_loss().defined());
  }
}

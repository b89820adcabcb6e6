// Context parallelism against one process: ring attention and all-to-all attention, causal and
// not, contiguous and zig-zag, give every rank its part of scaled_dot_product_attention on the
// whole sequence (values, and q, k, v gradients) to 1e-10 in float64; the zig-zag layout
// balances causal work; bad sequences raise on every rank.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "helpers.h"
#include "weave/weave.h"

using namespace weave;
using parallel::SequenceLayout;

namespace {

// The same tensor on every rank.
Tensor shared(const Shape& shape, uint64_t seed) {
  Generator g(seed);
  return randn(shape, {.dtype = kFloat64}, &g);
}

bool near(const Tensor& got, const Tensor& expected) {
  return got.shape() == expected.shape() && allclose(got, expected, 1e-10, 1e-12);
}

using Attention = Tensor (*)(const Tensor&, const Tensor&, const Tensor&, const dist::Group&,
                             const parallel::ContextParallelOptions&);

// One process on the whole sequence against the context-parallel parts of every rank.
void check_against_whole(Attention attention, bool causal, SequenceLayout layout) {
  const int n = dist::world_size();
  const dist::Group world = dist::world();
  const int64_t b = 2, h = 12, t = 4 * n, d = 4;
  Tensor q = shared({b, h, t, d}, 1).requires_grad_(), k = shared({b, h, t, d}, 2).requires_grad_(),
         v = shared({b, h, t, d}, 3).requires_grad_(), w = shared({b, h, t, d}, 4);
  // The objective is sum_r sum(y_r * w_r) = sum(y * w) over the whole sequence.
  Tensor y = scaled_dot_product_attention(q, k, v, {.causal = causal});
  (y * w).sum().backward();
  auto part = [&](const Tensor& x) { return parallel::shard_sequence(x, 2, world, layout); };
  Tensor qp = part(q.detach()).contiguous().requires_grad_(),
         kp = part(k.detach()).contiguous().requires_grad_(),
         vp = part(v.detach()).contiguous().requires_grad_();
  Tensor yp = attention(qp, kp, vp, world, {.causal = causal, .layout = layout});
  CHECK(near(yp, part(y.detach())));
  (yp * part(w)).sum().backward();
  CHECK(near(qp.grad(), part(q.grad())));
  CHECK(near(kp.grad(), part(k.grad())));
  CHECK(near(vp.grad(), part(v.grad())));
}

// Calls check(attention, causal, layout) for both modes, causal or not, and both layouts.
template <class Check>
void for_each_case(const Check& check) {
  for (Attention attention : {&parallel::ring_attention, &parallel::all_to_all_attention})
    for (bool causal : {false, true})
      for (SequenceLayout layout : {SequenceLayout::Contiguous, SequenceLayout::ZigZag}) {
        CAPTURE(attention == &parallel::ring_attention);
        CAPTURE(causal);
        CAPTURE(int(layout));
        check(attention, causal, layout);
      }
}

// Every rank's score count, gathered.
std::vector<int64_t> work_per_rank(bool causal, SequenceLayout layout) {
  const int n = dist::world_size();
  const dist::Group world = dist::world();
  Tensor x = shared({1, 2, 8 * n, 4}, 5);
  Tensor p = parallel::shard_sequence(x, 2, world, layout);
  parallel::RingAttentionStats stats;
  parallel::ring_attention(p, p, p, world, {.causal = causal, .layout = layout, .stats = &stats});
  Tensor all = empty({n}, {.dtype = kInt64});
  dist::all_gather(all, full({1}, double(stats.score_elements), {.dtype = kInt64}));
  return all.to_vector<int64_t>();
}

}  // namespace

TEST_SUITE("context_parallel") {
  TEST_CASE("ring and all-to-all attention equal attention on the whole sequence") {
    for_each_case(check_against_whole);
  }

  TEST_CASE("a rank that fails in ring attention's backward: every rank raises, the next runs") {
    const int n = dist::world_size();
    if (n < 2) return;
    const dist::Group world = dist::world();
    const int64_t b = 2, h = 4, t = 4 * n, d = 4;
    const Tensor q = shared({b, h, t, d}, 1), k = shared({b, h, t, d}, 2),
                 v = shared({b, h, t, d}, 3), w = shared({b, h, t, d}, 4);
    auto part = [&](const Tensor& x) {
      return parallel::shard_sequence(x, 2, world, SequenceLayout::ZigZag).contiguous();
    };
    Tensor qp = part(q).requires_grad_(), kp = part(k).requires_grad_(),
           vp = part(v).requires_grad_();
    const parallel::ContextParallelOptions options{.causal = true,
                                                   .layout = SequenceLayout::ZigZag};
    {  // the last rank changes a tensor the forward saved: its backward raises there
      Tensor yp = parallel::ring_attention(qp, kp, vp, world, options);
      if (dist::rank() == n - 1) qp.detach().mul_(1.0);
      const std::string error = test::error_of([&] { (yp * part(w)).sum().backward(); });
      CAPTURE(error);
      if (dist::rank() == n - 1)
        CHECK(error.find("modified") != std::string::npos);
      else
        CHECK(error.find("[ring_attention] another rank of group " + world.str() +
                         " failed to compute its part of ring attention's backward") == 0);
    }
    // The next step runs on every rank and equals one process on the whole sequence.
    for (Tensor* x : {&qp, &kp, &vp}) x->set_grad({});
    Tensor qw = q.clone().requires_grad_(), kw = k.clone().requires_grad_(),
           vw = v.clone().requires_grad_();
    (scaled_dot_product_attention(qw, kw, vw, {.causal = true}) * w).sum().backward();
    Tensor yp = parallel::ring_attention(qp, kp, vp, world, options);
    (yp * part(w)).sum().backward();
    CHECK(near(qp.grad(), part(qw.grad())));
    CHECK(near(kp.grad(), part(kw.grad())));
    CHECK(near(vp.grad(), part(vw.grad())));
    CHECK(autograd::must_run_pending() == 0);
  }

  TEST_CASE("under autocast, ring attention casts as attention does and follows it") {
    const dist::Group world = dist::world();
    const int n = dist::world_size();
    const SequenceLayout layout = SequenceLayout::ZigZag;
    auto part = [&](const Tensor& x) { return parallel::shard_sequence(x, 2, world, layout); };
    Tensor q = shared({1, 4, 8 * n, 8}, 21).to(kFloat32),
           k = shared({1, 4, 8 * n, 8}, 22).to(kFloat32),
           v = shared({1, 4, 8 * n, 8}, 23).to(kFloat32);
    Tensor whole, mine;
    Tensor qp = part(q).contiguous().requires_grad_();
    {
      AutocastGuard autocast(kBFloat16);
      whole = scaled_dot_product_attention(q, k, v, {.causal = true});
      mine = parallel::ring_attention(qp, part(k).contiguous(), part(v).contiguous(), world,
                                      {.causal = true, .layout = layout});
    }
    CHECK(whole.dtype() == kBFloat16);
    CHECK(mine.dtype() == kBFloat16);  // as the op under autocast: low precision out
    // The same bfloat16 inputs, merged in float32 instead of attended at once: within a few
    // bfloat16 roundings of the output.
    CHECK(max(abs(mine.to(kFloat32) - part(whole).to(kFloat32))).item<double>() < 2e-2);
    mine.to(kFloat32).sum().backward();
    CHECK(qp.grad().dtype() == kFloat32);  // the cast is recorded: the gradient comes back
    CHECK(all_finite(qp.grad()));
  }

  TEST_CASE("ring attention passes the distributed gradcheck") {
    const dist::Group world = dist::world();
    const int me = dist::rank();
    Generator g(100 + uint64_t(me));
    std::vector<Tensor> inputs;
    for (int i = 0; i < 3; ++i)
      inputs.push_back(randn({1, 1, 2, 2}, {.dtype = kFloat64}, &g).requires_grad_());
    auto result = dist::gradcheck(
        [&](const std::vector<Tensor>& x) {
          return parallel::ring_attention(x[0], x[1], x[2], world,
                                          {.causal = true, .layout = SequenceLayout::ZigZag});
        },
        inputs);
    CHECK_MESSAGE(result.ok, result.report);
    CHECK(result.checked == 12 * dist::world_size());
  }

  // Rotary embeddings at each rank's own positions (zig-zag: two runs of them), then ring
  // attention: the chain a context-parallel Llama runs, checked against finite differences of
  // the whole job's objective.
  TEST_CASE("rotary embeddings and ring attention pass the distributed gradcheck") {
    const dist::Group world = dist::world();
    const int me = dist::rank(), n = dist::world_size();
    std::vector<int64_t> all_positions(static_cast<size_t>(4 * n));
    for (size_t i = 0; i < all_positions.size(); ++i) all_positions[i] = int64_t(i);
    const Tensor positions = parallel::shard_sequence(from_vector(all_positions, {4 * n}), 0, world,
                                                      SequenceLayout::ZigZag);
    Generator g(200 + uint64_t(me));
    std::vector<Tensor> inputs;  // q, k, v parts [B, T / n, H, D]
    for (int i = 0; i < 3; ++i)
      inputs.push_back(randn({1, 4, 1, 4}, {.dtype = kFloat64}, &g).requires_grad_());
    auto result = dist::gradcheck(
        [&](const std::vector<Tensor>& x) {
          const RotaryOptions rope{.base = 100};
          Tensor q = rotary_embedding(x[0], positions, rope).transpose(1, 2);
          Tensor k = rotary_embedding(x[1], positions, rope).transpose(1, 2);
          return parallel::ring_attention(q, k, x[2].transpose(1, 2), world,
                                          {.causal = true, .layout = SequenceLayout::ZigZag});
        },
        inputs);
    CHECK_MESSAGE(result.ok, result.report);
    CHECK(result.checked == 48 * n);
  }

  TEST_CASE("under a causal mask the zig-zag layout balances the work, the contiguous does not") {
    const std::vector<int64_t> zigzag = work_per_rank(true, SequenceLayout::ZigZag);
    const auto [low, high] = std::minmax_element(zigzag.begin(), zigzag.end());
    CAPTURE(zigzag);
    CHECK(double(*high) < 1.1 * double(*low));
    if (dist::world_size() > 1) {
      const std::vector<int64_t> contiguous = work_per_rank(true, SequenceLayout::Contiguous);
      const auto [clow, chigh] = std::minmax_element(contiguous.begin(), contiguous.end());
      CAPTURE(contiguous);
      CHECK(double(*chigh) > 2.0 * double(*clow));
      // Without a mask every rank computes every score once.
      const std::vector<int64_t> full = work_per_rank(false, SequenceLayout::Contiguous);
      CHECK(std::all_of(full.begin(), full.end(), [&](int64_t x) { return x == full[0]; }));
    }
  }

  TEST_CASE("bad sequences raise on every rank") {
    const int n = dist::world_size(), me = dist::rank();
    const dist::Group world = dist::world();
    // A sequence that does not divide over the group (every rank holds the same whole).
    if (n > 1)
      CHECK_WEAVE_ERROR(parallel::shard_sequence(shared({1, 1, 2 * n + 1, 2}, 6), 2, world,
                                                 SequenceLayout::Contiguous),
                        "shard_sequence", "does not divide");
    CHECK_WEAVE_ERROR(
        parallel::shard_sequence(shared({1, 1, 3 * n, 2}, 6), 2, world, SequenceLayout::ZigZag),
        "shard_sequence", "two chunks each");
    // Ranks holding different lengths.
    if (n > 1) {
      Tensor x = shared({1, 2, me == 1 ? 4 : 2, 4}, 7);
      CHECK_WEAVE_ERROR(parallel::ring_attention(x, x, x, world), "ring_attention",
                        "different local sequence length");
    }
    // An odd length under zig-zag on rank 0 only.
    Tensor odd = shared({1, 2, me == 0 ? 3 : 4, 4}, 8);
    CHECK_WEAVE_ERROR(
        parallel::ring_attention(odd, odd, odd, world, {.layout = SequenceLayout::ZigZag}),
        "ring_attention", me == 0 || n == 1 ? "two equal chunks" : "rejected its arguments");
    // Heads that do not divide over the group.
    if (n > 1) {
      Tensor x = shared({1, 2 * n + 1, 4, 4}, 9);
      CHECK_WEAVE_ERROR(parallel::all_to_all_attention(x, x, x, world), "all_to_all_attention",
                        "do not divide");
    }
    // Different scales, or a scale on some ranks only: every rank raises.
    if (n > 1) {
      Tensor x = shared({1, 2, 4, 4}, 11);
      CHECK_WEAVE_ERROR(parallel::ring_attention(x, x, x, world, {.scale = me == 0 ? 0.5 : 0.25}),
                        "ring_attention", "different scale (from 0.25 to 0.5)");
      parallel::ContextParallelOptions only_rank_0;
      if (me == 0) only_rank_0.scale = 0.5;
      CHECK_WEAVE_ERROR(parallel::all_to_all_attention(x, x, x, world, only_rank_0),
                        "all_to_all_attention", "different scale (set or not)");
    }
    // Parts of odd length cannot be zig-zag parts: gathering them raises instead of scrambling.
    CHECK_WEAVE_ERROR(
        parallel::gather_sequence(shared({1, 1, 3, 2}, 12), 2, world, SequenceLayout::ZigZag),
        "gather_sequence", "two equal chunks");
    // An empty sequence: empty parts, empty gradients, as attention on the whole gives.
    for (auto layout : {SequenceLayout::Contiguous, SequenceLayout::ZigZag}) {
      Tensor e = shared({1, 2, 0, 4}, 13).requires_grad_();
      Tensor y = parallel::ring_attention(e, e, e, world, {.causal = true, .layout = layout});
      CHECK(y.shape() == e.shape());
      y.sum().backward();
      CHECK(e.grad().shape() == e.shape());
    }
    // Still in step afterwards.
    Tensor x = shared({1, 2, 4, 4}, 10);
    CHECK(parallel::ring_attention(x, x, x, world).shape() == x.shape());
  }

  // Packed documents that straddle ranks, with grouped-query heads: every rank's part of
  // attention with document ids on the whole sequence, values and gradients.
  TEST_CASE("ring and all-to-all attention over packed documents equal one rank") {
    const int n = dist::world_size();
    const dist::Group world = dist::world();
    const int64_t b = 2, t = 6 * n, d = 4;
    // Document lengths cycling 1, 5, 2, 7 (batch row 0) and 4, 1, 9 (row 1), cut at t.
    std::vector<int64_t> ids;
    for (const std::vector<int64_t>& lengths : {std::vector<int64_t>{1, 5, 2, 7}, {4, 1, 9}}) {
      int64_t doc = 0, left = lengths[0];
      for (int64_t i = 0; i < t; ++i) {
        if (left == 0) left = lengths[size_t(++doc) % lengths.size()];
        ids.push_back(doc);
        --left;
      }
    }
    const Tensor documents = from_vector(ids, {b, t});
    for_each_case([&](Attention attention, bool causal, SequenceLayout layout) {
      const bool ring = attention == &parallel::ring_attention;
      // Ring: 6 query heads share 2 key/value heads (3, at 3 ranks: any count works);
      // all-to-all: 2n query and n key/value heads, so both divide over the ranks.
      const int64_t h = ring ? 6 : 2 * n, kv = ring ? (n == 3 ? 3 : 2) : n;
      Tensor q = shared({b, h, t, d}, 21).requires_grad_(),
             k = shared({b, kv, t, d}, 22).requires_grad_(),
             v = shared({b, kv, t, d}, 23).requires_grad_(), w = shared({b, h, t, d}, 24);
      Tensor y =
          scaled_dot_product_attention(q, k, v, {.causal = causal, .document_ids = documents});
      (y * w).sum().backward();
      auto part = [&](const Tensor& x) { return parallel::shard_sequence(x, 2, world, layout); };
      Tensor qp = part(q.detach()).contiguous().requires_grad_(),
             kp = part(k.detach()).contiguous().requires_grad_(),
             vp = part(v.detach()).contiguous().requires_grad_();
      const Tensor my_ids = parallel::shard_sequence(documents, 1, world, layout);
      Tensor yp = attention(qp, kp, vp, world,
                            {.causal = causal, .layout = layout, .document_ids = my_ids});
      CHECK(near(yp, part(y.detach())));
      (yp * part(w)).sum().backward();
      CHECK(near(qp.grad(), part(q.grad())));
      CHECK(near(kp.grad(), part(k.grad())));
      CHECK(near(vp.grad(), part(v.grad())));
    });
  }

  // huggingface/trl#6843's probe: perturbing one token of document 1 must change document 1's
  // outputs (under a causal mask, only from that token on) and nothing else.
  TEST_CASE("a perturbed token changes only its own document's outputs") {
    const dist::Group world = dist::world();
    const int n = dist::world_size();
    const int64_t t = 8 * n, d = 4, first = 3 * n, last = 6 * n;  // document 1: [3n, 6n)
    std::vector<int64_t> ids(static_cast<size_t>(t));
    for (int64_t i = 0; i < t; ++i) ids[size_t(i)] = i < first ? 0 : (i < last ? 1 : 2);
    const Tensor documents = from_vector(ids, {t});
    const int64_t token = first + 2;
    for_each_case([&](Attention attention, bool causal, SequenceLayout layout) {
      Tensor x = shared({1, 2 * n, t, d}, 31), bumped = x.clone();
      bumped.narrow(2, token, 1).add_(full({}, 0.5, {.dtype = kFloat64}));
      auto run = [&](const Tensor& input) {
        const Tensor p = parallel::shard_sequence(input, 2, world, layout).contiguous();
        const Tensor y =
            attention(p, p, p, world,
                      {.causal = causal,
                       .layout = layout,
                       .document_ids = parallel::shard_sequence(documents, 0, world, layout)});
        return parallel::gather_sequence(y, 2, world, layout);
      };
      const std::vector<double> change =  // per position
          max(abs(run(bumped) - run(x)), {0, 1, 3}).to_vector<double>();
      for (int64_t i = 0; i < t; ++i) {
        CAPTURE(i);
        const bool should = i >= first && i < last && (!causal || i >= token);
        CHECK((change[size_t(i)] > 1e-9) == should);
      }
    });
  }
  // Windows that stay inside a chunk, reach one or two chunks back (into another rank's, under
  // either layout), or span the sequence; with soft-capped scores and packed documents.
  TEST_CASE("sliding windows over packed documents equal one rank, values and gradients") {
    const int n = dist::world_size();
    const dist::Group world = dist::world();
    const int64_t b = 2, t = 8 * n, d = 4, chunk_zigzag = 4, chunk_contiguous = 8;
    std::vector<int64_t> ids;  // documents of 11 and 7 positions (row 0), 5 (row 1)
    for (int64_t row = 0; row < b; ++row)
      for (int64_t i = 0; i < t; ++i)
        ids.push_back(row == 0 ? (i % 18 < 11 ? i / 18 * 2 : i / 18 * 2 + 1) : i / 5);
    const Tensor documents = from_vector(ids, {b, t});
    for (const int64_t window : {int64_t(1), int64_t(3), chunk_zigzag + 1, chunk_contiguous + 3, t})
      for (const bool packed : {false, true})
        for_each_case([&](Attention attention, bool causal, SequenceLayout layout) {
          if (!causal) return;
          CAPTURE(window);
          CAPTURE(packed);
          const bool ring = attention == &parallel::ring_attention;
          const int64_t h = 2 * n, kv = ring ? 2 : n;
          Tensor q = shared({b, h, t, d}, 41).requires_grad_(),
                 k = shared({b, kv, t, d}, 42).requires_grad_(),
                 v = shared({b, kv, t, d}, 43).requires_grad_(), w = shared({b, h, t, d}, 44);
          const Tensor ids_or_none = packed ? documents : Tensor();
          Tensor y = scaled_dot_product_attention(
              q, k, v,
              {.causal = true, .document_ids = ids_or_none, .window = window, .softcap = 1.5});
          (y * w).sum().backward();
          auto part = [&](const Tensor& x) {
            return parallel::shard_sequence(x, 2, world, layout);
          };
          Tensor qp = part(q.detach()).contiguous().requires_grad_(),
                 kp = part(k.detach()).contiguous().requires_grad_(),
                 vp = part(v.detach()).contiguous().requires_grad_();
          parallel::RingAttentionStats stats;
          Tensor yp = attention(
              qp, kp, vp, world,
              {.causal = true,
               .layout = layout,
               .stats = &stats,
               .window = window,
               .softcap = 1.5,
               .document_ids =
                   packed ? parallel::shard_sequence(documents, 1, world, layout) : Tensor()});
          CHECK(near(yp, part(y.detach())));
          (yp * part(w)).sum().backward();
          CHECK(near(qp.grad(), part(q.grad())));
          CHECK(near(kp.grad(), part(k.grad())));
          CHECK(near(vp.grad(), part(v.grad())));
          if (!ring) return;
          // The ring computes only what some window reaches: summed over the ranks, the
          // scores inside the windows (each window is min(window, position + 1) keys long).
          int64_t inside = 0;
          for (int64_t i = 0; i < t; ++i) inside += std::min(window, i + 1);
          Tensor total = full({1}, double(stats.score_elements), {.dtype = kInt64});
          dist::all_reduce(total);
          CHECK(total.item<int64_t>() == b * h * inside);
        });
  }
}

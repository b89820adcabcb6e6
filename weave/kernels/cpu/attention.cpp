// Fused attention on the CPU, blocked like FlashAttention-2: per (batch, head, query block) the
// scores of one key block at a time are formed by a GEMM, folded into a running maximum and sum
// (online softmax) and multiplied into the output; only each row's log-sum-exp is kept. The
// backward recomputes each block's probabilities from it. Grouped-query attention reads key and
// value head h / group for query head h (no copies); its backward runs one task per key/value
// head, summing the gradients of the group's query heads in a fixed order.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "weave/kernels/backends.h"
#include "weave/kernels/cpu/gemm.h"
#include "weave/kernels/cpu/loops.h"
#include "weave/kernels/cpu/vector_math.h"

namespace weave::kernels::cpu {

namespace {

constexpr int64_t kBlockQ = 64, kBlockK = 128;

/// A [B, H, T, D] operand: base pointer and element strides (the last one is 1).
template <class P>
struct Heads {
  P* base;
  int64_t batch_stride, head_stride, row_stride;
  Heads(const Tensor& t)  // NOLINT: converting is the point
      : base(static_cast<P*>(t.data_ptr())),
        batch_stride(t.strides()[0]),
        head_stride(t.strides()[1]),
        row_stride(t.strides()[2]) {}
  P* at(int64_t b, int64_t h, int64_t row = 0) const {
    return base + b * batch_stride + h * head_stride + row * row_stride;
  }
};

/// Everything that shapes a score: the soft-cap, the causal rule and window, documents, a
/// boolean or additive mask, and dropout.
template <class T>
struct Masking {
  int64_t tq, tk, heads;
  functors::KeyRange range;
  T cap;
  const int64_t* query_doc = nullptr;  // [B, Tq] and [B, Tk]: packed sequences' documents
  const int64_t* key_doc = nullptr;
  const T* additive = nullptr;
  const bool* allowed = nullptr;
  int64_t strides[4] = {0, 0, 0, 0};
  double dropout_p;
  uint64_t seed;
  T keep_scale;

  Masking(const Tensor& q, const Tensor& k, const Tensor& mask, const AttentionParams& params)
      : tq(q.size(2)),
        tk(k.size(2)),
        heads(q.size(1)),
        range(key_range(params, tq, tk)),
        cap(T(params.softcap)),
        dropout_p(params.dropout_p),
        seed(params.dropout_seed),
        keep_scale(T(1.0 / (1.0 - params.dropout_p))) {
    if (params.query_documents.defined()) {
      query_doc = params.query_documents.data<int64_t>();
      key_doc = params.key_documents.data<int64_t>();
    }
    if (mask.defined()) {
      if (mask.dtype() == kBool)
        allowed = static_cast<const bool*>(mask.data_ptr());
      else
        additive = static_cast<const T*>(mask.data_ptr());
      for (int d = 0; d < 4; ++d) strides[d] = mask.strides()[d];
    }
  }

  /// False where queries [i0, i0 + rows) and keys [j0, j0 + cols) of batch entry b can share no
  /// document (their ranges of ids are disjoint): the block is skipped, not computed and masked.
  bool meets(int64_t b, int64_t i0, int64_t rows, int64_t j0, int64_t cols) const {
    if (!query_doc) return true;
    const auto [q_low, q_high] =
        std::minmax_element(query_doc + b * tq + i0, query_doc + b * tq + i0 + rows);
    const auto [k_low, k_high] =
        std::minmax_element(key_doc + b * tk + j0, key_doc + b * tk + j0 + cols);
    return *k_high >= *q_low && *k_low <= *q_high;
  }

  /// Soft-caps a rows x cols block of scaled scores at (i0, j0), copying the capped values to
  /// `capped` (same layout) when given, then applies the causal rule, window and masks.
  void apply(T* s, int64_t ld, int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0,
             int64_t cols, T* capped = nullptr) const {
    constexpr T kMinusInf = -std::numeric_limits<T>::infinity();
    for (int64_t r = 0; r < rows; ++r) {
      T* row = s + r * ld;
      const int64_t i = i0 + r;
      if (cap > T(0))
        for (int64_t c = 0; c < cols; ++c) row[c] = functors::softcap(row[c], cap);
      if (capped) std::copy_n(row, cols, capped + r * ld);
      const int64_t begin = range.begin(i) - j0, end = range.end(i) - j0;
      for (int64_t c = 0; c < std::min(begin, cols); ++c) row[c] = kMinusInf;
      for (int64_t c = std::max<int64_t>(0, end); c < cols; ++c) row[c] = kMinusInf;
      if (query_doc) {
        const int64_t document = query_doc[b * tq + i];
        const int64_t* keys = key_doc + b * tk + j0;
        for (int64_t c = 0; c < cols; ++c)
          if (keys[c] != document) row[c] = kMinusInf;
      }
      const int64_t base = b * strides[0] + h * strides[1] + i * strides[2] + j0 * strides[3];
      if (additive)
        for (int64_t c = 0; c < cols; ++c) row[c] += additive[base + c * strides[3]];
      if (allowed)
        for (int64_t c = 0; c < cols; ++c)
          if (!allowed[base + c * strides[3]]) row[c] = kMinusInf;
    }
  }

  /// Takes a block of the capped scores' gradient through the soft-cap to the raw scores (a
  /// mask adds after the cap: its gradient is the one before).
  void through_cap(T* ds, const T* capped, int64_t ld, int64_t rows, int64_t cols) const {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        ds[r * ld + c] *= functors::softcap_grad(capped[r * ld + c], cap);
  }

  /// Multiplies a block of probabilities by the dropout mask over 1 - p.
  void drop(T* p, int64_t ld, int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0,
            int64_t cols) const {
    if (dropout_p == 0) return;
    for (int64_t r = 0; r < rows; ++r) {
      const uint64_t first = uint64_t(((b * heads + h) * tq + i0 + r) * tk + j0);
      for (int64_t c = 0; c < cols; ++c)
        p[r * ld + c] *= functors::dropout_keep(seed, first + c, dropout_p) ? keep_scale : T(0);
    }
  }
};

template <class T>
void forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
             const AttentionParams& params, const Tensor& out, const Tensor& lse) {
  const int64_t batch = q.size(0), heads = q.size(1), tq = q.size(2), d = q.size(3);
  const int64_t dv = v.size(3), group = heads / k.size(1);
  const Heads<const T> Q(q), K(k), V(v);
  const Heads<T> O(out);
  T* L = lse.data<T>();
  const Masking<T> masking(q, k, mask, params);
  const int64_t blocks = (tq + kBlockQ - 1) / kBlockQ, tasks = batch * heads * blocks;
  const T scale = T(params.scale);
  const int threads = threads_for(tasks * kBlockQ * k.size(2) * d);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<T> scores(kBlockQ * kBlockK), acc(kBlockQ * dv), row_max(kBlockQ), row_sum(kBlockQ);
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / (heads * blocks), h = task / blocks % heads, kv = h / group;
      const int64_t i0 = task % blocks * kBlockQ, rows = std::min(kBlockQ, tq - i0);
      std::fill_n(row_max.data(), rows, -std::numeric_limits<T>::infinity());
      std::fill_n(row_sum.data(), rows, T(0));
      std::fill_n(acc.data(), rows * dv, T(0));
      const int64_t keys = masking.range.end(i0 + rows - 1);
      for (int64_t j0 = masking.range.begin(i0); j0 < keys; j0 += kBlockK) {
        const int64_t cols = std::min(kBlockK, keys - j0);
        if (!masking.meets(b, i0, rows, j0, cols)) continue;
        T* s = scores.data();
        gemm<T>(false, true, rows, cols, d, scale, Q.at(b, h, i0), Q.row_stride, K.at(b, kv, j0),
                K.row_stride, T(0), s, kBlockK);
        masking.apply(s, kBlockK, b, h, i0, rows, j0, cols);
        for (int64_t r = 0; r < rows; ++r) {
          T* sr = s + r * kBlockK;
          const T block_max = cpu::row_max(sr, cols);
          const T m = block_max > row_max[r] || block_max != block_max ? block_max : row_max[r];
          const T shift = safe_shift(m);  // a row masked so far keeps max -inf
          const T correction = std::exp(row_max[r] - shift);
          row_sum[r] = row_sum[r] * correction + exp_shifted_in_place(sr, cols, shift);
          if (correction != T(1))
            for (int64_t c = 0; c < dv; ++c) acc[r * dv + c] *= correction;
          row_max[r] = m;
        }
        masking.drop(s, kBlockK, b, h, i0, rows, j0, cols);
        gemm<T>(false, false, rows, dv, cols, T(1), s, kBlockK, V.at(b, kv, j0), V.row_stride, T(1),
                acc.data(), dv);
      }
      for (int64_t r = 0; r < rows; ++r) {
        T* o = O.at(b, h, i0 + r);
        const T l = row_sum[r];
        const T inverse = l > T(0) ? T(1) / l : T(0);
        for (int64_t c = 0; c < dv; ++c) o[c] = acc[r * dv + c] * inverse;
        L[(b * heads + h) * tq + i0 + r] =
            l > T(0) ? row_max[r] + std::log(l) : std::numeric_limits<T>::infinity();
      }
    }
  }
}

/// What one backward task (a batch entry and a key/value head) works with.
template <class T>
struct BackwardTask {
  std::vector<T> probs, dprobs, capped, dk_acc, dv_acc, delta;
  BackwardTask(int64_t d, int64_t dv, int64_t rows, bool softcap)
      : probs(kBlockQ * kBlockK),
        dprobs(kBlockQ * kBlockK),
        capped(softcap ? kBlockQ * kBlockK : 0),
        dk_acc(kBlockK * d),
        dv_acc(kBlockK * dv),
        delta(rows) {}
  /// delta_i = sum_c dO_ic O_ic = sum_j P_ij dP_ij (dropout included) for query heads [h0, h0 +
  /// group) of batch entry b, and their dq rows zeroed.
  void start(const Heads<const T>& G, const Heads<const T>& O, const Heads<T>& DQ, int64_t b,
             int64_t h0, int64_t group, int64_t tq, int64_t d, int64_t dv) {
    for (int64_t h = h0; h < h0 + group; ++h)
      for (int64_t i = 0; i < tq; ++i) {
        const T *g = G.at(b, h, i), *o = O.at(b, h, i);
        delta[(h - h0) * tq + i] = row_sum<T>(dv, [&](int64_t c) { return g[c] * o[c]; });
        std::fill_n(DQ.at(b, h, i), d, T(0));
      }
  }
};

template <class T>
void backward(const Tensor& grad, const Tensor& q, const Tensor& k, const Tensor& v,
              const Tensor& mask, const AttentionParams& params, const Tensor& out,
              const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv_out,
              const Tensor& dmask) {
  const int64_t batch = q.size(0), heads = q.size(1), tq = q.size(2), tk = k.size(2);
  const int64_t d = q.size(3), dv = v.size(3), kv_heads = k.size(1), group = heads / kv_heads;
  const Heads<const T> Q(q), K(k), V(v), O(out), G(grad);
  const Heads<T> DQ(dq), DK(dk), DV(dv_out);
  const T* L = lse.data<T>();
  T* dscores = dmask.defined() ? dmask.data<T>() : nullptr;
  if (dscores) std::fill_n(dscores, dmask.numel(), T(0));
  const Masking<T> masking(q, k, mask, params);
  const T scale = T(params.scale);
  // Query block [i0, i0 + rows) of query head h against key block [j0, j0 + cols) of its
  // key/value head kv: adds to dq directly and to the task's dk/dv accumulators.
  auto block = [&](BackwardTask<T>& w, int64_t b, int64_t h, int64_t kv, int64_t i0, int64_t j0,
                   int64_t cols) {
    const int64_t rows = std::min(kBlockQ, tq - i0), row0 = (b * heads + h) * tq;
    if (!masking.meets(b, i0, rows, j0, cols)) return;
    const T* delta = w.delta.data() + (h % group) * tq;
    T *p = w.probs.data(), *dp = w.dprobs.data();
    gemm<T>(false, true, rows, cols, d, scale, Q.at(b, h, i0), Q.row_stride, K.at(b, kv, j0),
            K.row_stride, T(0), p, kBlockK);
    T* capped = w.capped.empty() ? nullptr : w.capped.data();
    masking.apply(p, kBlockK, b, h, i0, rows, j0, cols, capped);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        p[r * kBlockK + c] = std::exp(p[r * kBlockK + c] - L[row0 + i0 + r]);
    // dV += P_dropped^T dO
    const T* dropped = p;
    if (params.dropout_p > 0) {
      std::copy(p, p + rows * kBlockK, dp);
      masking.drop(dp, kBlockK, b, h, i0, rows, j0, cols);
      dropped = dp;
    }
    gemm<T>(true, false, cols, dv, rows, T(1), dropped, kBlockK, G.at(b, h, i0), G.row_stride, T(1),
            w.dv_acc.data(), dv);
    // dP = dO V^T (through the dropout mask), dS = P (dP - delta)
    gemm<T>(false, true, rows, cols, dv, T(1), G.at(b, h, i0), G.row_stride, V.at(b, kv, j0),
            V.row_stride, T(0), dp, kBlockK);
    masking.drop(dp, kBlockK, b, h, i0, rows, j0, cols);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) p[r * kBlockK + c] *= dp[r * kBlockK + c] - delta[i0 + r];
    if (dscores)
      for (int64_t r = 0; r < rows; ++r)
        std::copy_n(p + r * kBlockK, cols, dscores + (row0 + i0 + r) * tk + j0);
    if (capped) masking.through_cap(p, capped, kBlockK, rows, cols);
    // dQ += scale dS K, dK += scale dS^T Q
    gemm<T>(false, false, rows, d, cols, scale, p, kBlockK, K.at(b, kv, j0), K.row_stride, T(1),
            DQ.at(b, h, i0), DQ.row_stride);
    gemm<T>(true, false, cols, d, rows, scale, p, kBlockK, Q.at(b, h, i0), Q.row_stride, T(1),
            w.dk_acc.data(), d);
  };
  const int64_t tasks = batch * kv_heads;
  const int threads = threads_for(batch * heads * tq * tk * d);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    BackwardTask<T> w(d, dv, group * tq, params.softcap > 0);
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / kv_heads, kv = task % kv_heads;
      w.start(G, O, DQ, b, kv * group, group, tq, d, dv);
      for (int64_t j0 = 0; j0 < tk; j0 += kBlockK) {
        const int64_t cols = std::min(kBlockK, tk - j0);
        std::fill(w.dk_acc.begin(), w.dk_acc.end(), T(0));
        std::fill(w.dv_acc.begin(), w.dv_acc.end(), T(0));
        const int64_t first = masking.range.first_query(j0) / kBlockQ * kBlockQ;
        const int64_t end = masking.range.query_end(j0 + cols - 1);
        for (int64_t h = kv * group; h < (kv + 1) * group; ++h)
          for (int64_t i0 = first; i0 < end; i0 += kBlockQ) block(w, b, h, kv, i0, j0, cols);
        for (int64_t c = 0; c < cols; ++c) {
          std::copy_n(w.dk_acc.data() + c * d, d, DK.at(b, kv, j0 + c));
          std::copy_n(w.dv_acc.data() + c * dv, dv, DV.at(b, kv, j0 + c));
        }
      }
    }
  }
}

}  // namespace

void attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
               const AttentionParams& params, const Tensor& out, const Tensor& lse) {
  visit_floating(q.dtype(), "scaled_dot_product_attention", [&](auto tag) {
    forward<typename decltype(tag)::type>(q, k, v, mask, params, out, lse);
  });
}

void attention_backward(const Tensor& grad, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& mask, const AttentionParams& params, const Tensor& out,
                        const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                        const Tensor& dmask) {
  visit_floating(q.dtype(), "scaled_dot_product_attention", [&](auto tag) {
    backward<typename decltype(tag)::type>(grad, q, k, v, mask, params, out, lse, dq, dk, dv,
                                           dmask);
  });
}

void attention_softmax(const Tensor& s, const AttentionParams& params, const Tensor& lse) {
  visit_floating(s.dtype(), "attention_softmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const functors::KeyRange range = key_range(params, s.size(1), s.size(2));
    const int64_t tk = range.tk, rows = s.numel() / std::max<int64_t>(tk, 1);
    const T scale = T(params.scale), cap = T(params.softcap);
    T* data = s.data<T>();
    T* out_lse = lse.data<T>();
    for (int64_t r = 0; r < rows; ++r) {
      T* row = data + r * tk;
      const int64_t begin = range.begin(r % range.tq), end = range.end(r % range.tq);
      for (int64_t j = 0; j < tk; ++j) row[j] = functors::softcap(row[j] * scale, cap);
      T m = -INFINITY, sum = 0;
      for (int64_t j = begin; j < end; ++j) m = std::max(m, row[j]);
      for (int64_t j = begin; j < end; ++j) sum += std::exp(row[j] - m);
      for (int64_t j = 0; j < tk; ++j)
        row[j] = j >= begin && j < end ? std::exp(row[j] - m) / sum : T(0);
      out_lse[r] = m + std::log(sum);
    }
  });
}

void attention_probs(const Tensor& s, const AttentionParams& params, const Tensor& lse,
                     const Tensor& capped) {
  visit_floating(s.dtype(), "attention_probs", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const functors::KeyRange range = key_range(params, s.size(1), s.size(2));
    const int64_t tk = range.tk, rows = s.numel() / std::max<int64_t>(tk, 1);
    const T scale = T(params.scale), cap = T(params.softcap);
    T* data = s.data<T>();
    const T* row_lse = lse.data<T>();
    T* kept = capped.defined() ? capped.data<T>() : nullptr;
    for (int64_t r = 0; r < rows; ++r) {
      T* row = data + r * tk;
      for (int64_t j = 0; j < tk; ++j) {
        const T value = functors::softcap(row[j] * scale, cap);
        if (kept) kept[r * tk + j] = value;
        row[j] = range.sees(r % range.tq, j) ? std::exp(value - row_lse[r]) : T(0);
      }
    }
  });
}

void attention_score_grad(const Tensor& dp, const Tensor& p, const Tensor& delta, double scale,
                          const Tensor& capped, double softcap) {
  visit_floating(dp.dtype(), "attention_score_grad", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int64_t tk = dp.size(2), n = dp.numel();
    T* d = dp.data<T>();
    const T* probs = p.data<T>();
    const T* row_delta = delta.data<T>();
    const T* kept = capped.defined() ? capped.data<T>() : nullptr;
    for (int64_t e = 0; e < n; ++e) {
      const T through_cap = kept ? functors::softcap_grad(kept[e], T(softcap)) : T(1);
      d[e] = T(scale) * probs[e] * (d[e] - row_delta[e / tk]) * through_cap;
    }
  });
}

}  // namespace weave::kernels::cpu

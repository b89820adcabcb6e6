// Attention over blocks of heads through matrix products (see attention_blocks.h).
//   forward   S = scale q k^T (masked causally), P = softmax(S), out = P v,
//             lse = max S - log max P (the row's log-sum-exp without another pass over exp)
//   backward  P again from S, dv = P^T g, dP = g v^T, dS = P (dP - rowsum(g o)),
//             dq = scale dS k, dk = scale dS^T q
#include "weave/ops/attention_blocks.h"

#include <algorithm>
#include <atomic>
#include <cmath>

#include "weave/autograd/grad_mode.h"
#include "weave/ops/autocast.h"
#include "weave/ops/internal.h"
#include "weave/ops/ops.h"

namespace weave::detail {

namespace {

std::atomic<bool> everywhere{false};

// Scores of one block stay under this many bytes (a few such tensors live at once).
constexpr int64_t kBlockBytes = int64_t(128) << 20;
std::atomic<int64_t> block_bytes{kBlockBytes};

/// Heads [h0, h0 + n) of batch entry b of a [B, H, T, D] tensor: a [n, T, D] view.
Tensor heads(const Tensor& t, int64_t b, int64_t h0, int64_t n) {
  return t.select(0, b).narrow(0, h0, n);
}

/// Calls body(b, h0, n) over blocks of heads whose scores fit the budget.
template <class Body>
void for_each_block(const Tensor& q, const Tensor& k, const Body& body) {
  const int64_t scores = std::max<int64_t>(1, q.size(2) * k.size(2) * int64_t(q.itemsize()));
  const int64_t per_block = std::clamp<int64_t>(block_bytes.load() / scores, 1, q.size(1));
  for (int64_t b = 0; b < q.size(0); ++b)
    for (int64_t h0 = 0; h0 < q.size(1); h0 += per_block)
      body(b, h0, std::min(per_block, q.size(1) - h0));
}

/// [Tq, Tk] true where a causal query may not see the key (bottom-right aligned), or undefined.
Tensor hidden_keys(const Tensor& q, const Tensor& k, bool causal) {
  if (!causal) return Tensor();
  const int64_t tq = q.size(2), tk = k.size(2);
  Tensor ones_mask = ones({tq, tk}, {.dtype = kFloat32, .device = q.device()});
  return gt(triu(ones_mask, 1 + tk - tq), scalar_tensor(0.5, {.device = q.device()}));
}

/// The block's scores, masked.
Tensor block_scores(const Tensor& qb, const Tensor& kb, const kernels::AttentionParams& params,
                    const Tensor& hidden) {
  Tensor s = matmul(qb, kb.transpose(1, 2)) * params.scale;
  return hidden.defined() ? masked_fill(s, hidden, -INFINITY) : s;
}

}  // namespace

void set_attention_by_blocks_everywhere(bool on, int64_t bytes) {
  everywhere = on;
  block_bytes = bytes > 0 ? bytes : kBlockBytes;
}

bool attention_by_blocks(const Tensor& q, const Tensor& k, const Tensor& mask,
                         const kernels::AttentionParams& params) {
  if (!everywhere.load() && !q.device().is_cuda()) return false;
  const bool float_operands = q.dtype() == kFloat32 || q.dtype() == kFloat64;
  const bool rows_see_keys = k.size(2) > 0 && (!params.causal || k.size(2) >= q.size(2));
  return float_operands && rows_see_keys && !mask.defined() && params.dropout_p == 0;
}

void blocked_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                       const kernels::AttentionParams& params, const Tensor& out,
                       const Tensor& lse) {
  NoGradGuard no_grad;
  AutocastGuard exact(kBFloat16, false);  // the products stay in the operands' dtype
  const Tensor hidden = hidden_keys(q, k, params.causal);
  for_each_block(q, k, [&](int64_t b, int64_t h0, int64_t n) {
    Tensor s = block_scores(heads(q, b, h0, n), heads(k, b, h0, n), params, hidden);
    Tensor row_max = max(s, {-1});
    Tensor p = softmax(s, -1);
    heads(out, b, h0, n).copy_(matmul(p, heads(v, b, h0, n)));
    lse.select(0, b).narrow(0, h0, n).copy_(row_max - log(max(p, {-1})));
  });
}

void blocked_attention_backward(const Tensor& grad, const Tensor& q, const Tensor& k,
                                const Tensor& v, const kernels::AttentionParams& params,
                                const Tensor& out, const Tensor& lse, const Tensor& dq,
                                const Tensor& dk, const Tensor& dv) {
  NoGradGuard no_grad;
  AutocastGuard exact(kBFloat16, false);
  const Tensor hidden = hidden_keys(q, k, params.causal);
  for_each_block(q, k, [&](int64_t b, int64_t h0, int64_t n) {
    Tensor qb = heads(q, b, h0, n), kb = heads(k, b, h0, n), vb = heads(v, b, h0, n);
    Tensor gb = heads(grad, b, h0, n);
    Tensor row_lse = lse.select(0, b).narrow(0, h0, n).unsqueeze(-1);
    Tensor p = exp(block_scores(qb, kb, params, hidden) - row_lse);
    heads(dv, b, h0, n).copy_(matmul(p.transpose(1, 2), gb));
    Tensor delta = sum(gb * heads(out, b, h0, n), {-1}, true);
    Tensor ds = p * (matmul(gb, vb.transpose(1, 2)) - delta);
    heads(dq, b, h0, n).copy_(matmul(ds, kb) * params.scale);
    heads(dk, b, h0, n).copy_(matmul(ds.transpose(1, 2), qb) * params.scale);
  });
}

}  // namespace weave::detail

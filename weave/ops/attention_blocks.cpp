// Attention over blocks of heads through matrix products (see attention_blocks.h).
//   forward   S = q k^T, P = softmax(softcap(scale S) masked causally and by the window) with
//             each row's log-sum-exp in one row pass (kernels::attention_softmax), out = P v
//   backward  P = exp(softcap(scale S) - lse) in one pass, dv = P^T g, dP = g v^T,
//             dS' = scale P (dP - rowsum(g o)) softcap' in one pass, dq = dS' k, dk = dS'^T q
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

/// The block's raw scores q k^T [n, Tq, Tk] (contiguous, scaled and masked by the row passes).
Tensor block_scores(const Tensor& qb, const Tensor& kb) {
  return matmul(qb, kb.transpose(1, 2));
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
  const bool rows_see_keys =
      k.size(2) > 0 && kernels::key_range(params, q.size(2), k.size(2)).every_query_sees_a_key();
  const bool one_kv_head_each = k.size(1) == q.size(1);  // grouped queries: the fused kernels
  return float_operands && rows_see_keys && one_kv_head_each && !mask.defined() &&
         params.dropout_p == 0 && !params.query_documents.defined();
}

void blocked_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                       const kernels::AttentionParams& params, const Tensor& out,
                       const Tensor& lse) {
  NoGradGuard no_grad;
  AutocastGuard exact(kBFloat16, false);  // the products stay in the operands' dtype
  for_each_block(q, k, [&](int64_t b, int64_t h0, int64_t n) {
    Tensor p = block_scores(heads(q, b, h0, n), heads(k, b, h0, n));
    kernels::attention_softmax(p, params, lse.select(0, b).narrow(0, h0, n));
    heads(out, b, h0, n).copy_(matmul(p, heads(v, b, h0, n)));
  });
}

void blocked_attention_backward(const Tensor& grad, const Tensor& q, const Tensor& k,
                                const Tensor& v, const kernels::AttentionParams& params,
                                const Tensor& out, const Tensor& lse, const Tensor& dq,
                                const Tensor& dk, const Tensor& dv) {
  NoGradGuard no_grad;
  AutocastGuard exact(kBFloat16, false);
  for_each_block(q, k, [&](int64_t b, int64_t h0, int64_t n) {
    Tensor qb = heads(q, b, h0, n), kb = heads(k, b, h0, n), vb = heads(v, b, h0, n);
    Tensor gb = heads(grad, b, h0, n);
    Tensor p = block_scores(qb, kb);
    Tensor capped = params.softcap > 0 ? empty_on(p.shape(), p.dtype(), p.device()) : Tensor();
    kernels::attention_probs(p, params, lse.select(0, b).narrow(0, h0, n), capped);
    heads(dv, b, h0, n).copy_(matmul(p.transpose(1, 2), gb));
    Tensor delta = sum(gb * heads(out, b, h0, n), {-1}).contiguous();
    Tensor ds = matmul(gb, vb.transpose(1, 2));
    kernels::attention_score_grad(ds, p, delta, params.scale, capped, params.softcap);
    heads(dq, b, h0, n).copy_(matmul(ds, kb));
    heads(dk, b, h0, n).copy_(matmul(ds.transpose(1, 2), qb));
  });
}

}  // namespace weave::detail

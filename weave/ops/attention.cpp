// scaled_dot_product_attention: checks, layouts and the autograd record around the fused
// kernels (kernels/cpu/attention.cpp, kernels/cuda/attention.cu).
#include <cmath>

#include "weave/ops/autocast.h"
#include "weave/ops/internal.h"

namespace weave {

using namespace detail;

namespace {

constexpr const char* kOp = "scaled_dot_product_attention";

/// t in dtype with unit stride in its last dim (a copy only when needed).
Tensor unit_inner(const Tensor& t, DType dtype) {
  Tensor c = convert(t, dtype);
  return c.size(-1) <= 1 || c.strides()[3] == 1 ? c : c.contiguous();
}

/// t as the operand of the kernels: in the computation dtype with unit inner stride, or (for
/// the tensor-core kernels, which take bfloat16/float16 as it is) with aligned rows.
Tensor operand(const Tensor& t, DType dtype) {
  if (!is_reduced_float(dtype)) return unit_inner(t, dtype);
  if (kernels::attention_rows_aligned(t)) return t;
  Tensor packed = empty_on(t.shape(), t.dtype(), t.device());
  kernels::copy(t, packed);
  return packed;
}

/// A [B, H, T, D] tensor stored as [B, T, H, D]: merging heads afterwards is a view.
Tensor empty_heads_last(int64_t b, int64_t h, int64_t t, int64_t d, DType dtype, Device device) {
  Tensor storage = empty_on({b, t, h, d}, dtype, device);
  return make_view(storage, {b, h, t, d}, {t * h * d, d, h * d, 1}, 0);
}

uint64_t draw_seed(Generator* generator) {
  Generator& g = generator ? *generator : default_generator();
  return g.engine()();
}

struct Checked {
  Tensor q, k, v, mask;
  kernels::AttentionParams params;
  DType out_dtype;
};

Checked check_and_prepare(const Tensor& q, const Tensor& k, const Tensor& v,
                          const AttentionOptions& options) {
  check_defined(q, kOp, "q");
  check_defined(k, kOp, "k");
  check_defined(v, kOp, "v");
  check_same_device(q, k, kOp);
  check_same_device(q, v, kOp);
  WEAVE_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, kOp,
              "expected q, k, v of shape [B, H, T, D], found {}, {} and {}; hint: a [B, T, H, D] "
              "projection becomes [B, H, T, D] with .transpose(1, 2)",
              q.shape(), k.shape(), v.shape());
  WEAVE_CHECK(q.size(0) == k.size(0) && q.size(0) == v.size(0) && q.size(1) == k.size(1) &&
                  q.size(1) == v.size(1),
              kOp, "q {}, k {} and v {} differ in batch or heads", q.shape(), k.shape(), v.shape());
  WEAVE_CHECK(k.size(2) == v.size(2), kOp, "k {} and v {} differ in length", k.shape(), v.shape());
  WEAVE_CHECK(q.size(3) == k.size(3), kOp, "q {} and k {} differ in head size", q.shape(),
              k.shape());
  WEAVE_CHECK(q.dtype() == k.dtype() && q.dtype() == v.dtype() && is_floating(q.dtype()), kOp,
              "expected q, k, v of one floating dtype, found {}, {} and {}", q.dtype(), k.dtype(),
              v.dtype());
  WEAVE_CHECK(options.dropout_p >= 0 && options.dropout_p < 1, kOp,
              "dropout_p must be in [0, 1), found {}", options.dropout_p);
  const double scale =
      options.scale.value_or(1.0 / std::sqrt(double(std::max<int64_t>(q.size(3), 1))));
  WEAVE_CHECK(std::isfinite(scale), kOp, "scale must be finite, found {}", scale);
  Checked c;
  c.out_dtype = q.dtype();
  c.params.scale = scale;
  c.params.causal = options.causal;
  c.params.dropout_p = options.dropout_p;
  if (options.dropout_p > 0) c.params.dropout_seed = draw_seed(options.generator);
  // bfloat16/float16 stay as they are where the device has tensor-core attention for the case;
  // anything else computes in float32 (float64 in float64).
  const DType dtype = kernels::attention_takes_reduced(q, k, v, options.mask, c.params)
                          ? q.dtype()
                          : kernel_dtype(q.dtype());
  c.q = operand(q, dtype);
  c.k = operand(k, dtype);
  c.v = operand(v, dtype);
  const Shape scores{q.size(0), q.size(1), q.size(2), k.size(2)};
  if (options.mask.defined()) {
    const Tensor& m = options.mask;
    check_same_device(q, m, kOp);
    WEAVE_CHECK(m.dtype() == kBool || is_floating(m.dtype()), kOp,
                "expected a bool or floating mask, found {}", m.dtype());
    bool broadcasts = m.dim() <= 4;
    for (int d = 0; broadcasts && d < m.dim(); ++d) {
      const int64_t size = m.shape()[d], want = scores[4 - m.dim() + d];
      broadcasts = size == want || size == 1;
    }
    WEAVE_CHECK(broadcasts, kOp, "mask {} does not broadcast to the scores [B, H, Tq, Tk] = {}",
                m.shape(), scores);
    c.mask = broadcast_view(m.dtype() == kBool ? m : convert(m, dtype), scores);
  }
  return c;
}

}  // namespace

AttentionResult scaled_dot_product_attention_with_lse(const Tensor& q, const Tensor& k,
                                                      const Tensor& v,
                                                      const AttentionOptions& options) {
  if (autocast_dtype()) {
    const char* op = "scaled_dot_product_attention";
    Tensor qc = autocast_input(q, op, "q"), kc = autocast_input(k, op, "k");
    Tensor vc = autocast_input(v, op, "v");
    if (!qc.is_same(q) || !kc.is_same(k) || !vc.is_same(v))
      return scaled_dot_product_attention_with_lse(qc, kc, vc, options);
  }
  Checked c = check_and_prepare(q, k, v, options);
  const int64_t b = q.size(0), h = q.size(1), tq = q.size(2), dv = v.size(3);
  const DType dtype = c.q.dtype();
  Tensor out = empty_heads_last(b, h, tq, dv, dtype, q.device());
  Tensor lse = empty_on({b, h, tq}, kernel_dtype(dtype), q.device());
  if (out.numel() > 0 || lse.numel() > 0) {
    if (k.size(2) == 0) {  // no key to attend to: every row is empty
      kernels::fill(out, 0);
      kernels::fill(lse, INFINITY);
    } else {
      kernels::attention(c.q, c.k, c.v, c.mask, c.params, out, lse);
    }
  }
  // P = softmax(S), S = scale q k^T:  dv = P^T g,  dS = P (g v^T - rowsum(g o)),
  // dq = scale dS k,  dk = scale dS^T q  (dropout's mask regenerated from its seed)
  // An additive mask that requires grad (a learned position bias) gets dS, summed over the
  // dims it was broadcast along; only then is a Tq x Tk gradient formed.
  const Tensor& mask_input = options.mask;
  const bool mask_grad = mask_input.defined() && mask_input.dtype() != kBool;
  Tensor output = autograd::record(
      "ScaledDotProductAttentionBackward", {q, k, v, mask_grad ? mask_input : Tensor()},
      convert(out, c.out_dtype), [&] {
        return [qs = SavedTensor(c.q), ks = SavedTensor(c.k), vs = SavedTensor(c.v),
                os = SavedTensor(out), lse, mask = c.mask, params = c.params, qi = InputInfo(q),
                ki = InputInfo(k), vi = InputInfo(v),
                mi = InputInfo(mask_input)](const BackwardArgs& args) -> Grads {
          Tensor qv = qs.unpack(), kv = ks.unpack(), vv = vs.unpack();
          Tensor g = operand(args.grad(), qv.dtype());
          Tensor dq = empty_heads_last(qv.size(0), qv.size(1), qv.size(2), qv.size(3), qv.dtype(),
                                       qv.device());
          Tensor dk = empty_heads_last(kv.size(0), kv.size(1), kv.size(2), kv.size(3), kv.dtype(),
                                       kv.device());
          Tensor dvv = empty_heads_last(vv.size(0), vv.size(1), vv.size(2), vv.size(3), vv.dtype(),
                                        vv.device());
          Tensor dmask = args.needs(3) ? empty_on({qv.size(0), qv.size(1), qv.size(2), kv.size(2)},
                                                  qv.dtype(), qv.device())
                                       : Tensor();
          if (kv.size(2) == 0) {
            for (const Tensor& t : {dq, dk, dvv}) kernels::fill(t, 0);
            if (dmask.defined()) kernels::fill(dmask, 0);
          } else if (dq.numel() > 0 || dk.numel() > 0) {
            kernels::attention_backward(g, qv, kv, vv, mask, params, os.unpack(), lse, dq, dk, dvv,
                                        dmask);
          }
          return {convert(dq, qi.dtype), convert(dk, ki.dtype), convert(dvv, vi.dtype),
                  dmask.defined() ? reduce_grad(dmask, mi) : Tensor()};
        };
      });
  return {output, lse};
}

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const AttentionOptions& options) {
  return scaled_dot_product_attention_with_lse(q, k, v, options).output;
}

Tensor attention_dropout_mask(const Shape& scores_shape, double p, Generator* generator) {
  WEAVE_CHECK(scores_shape.size() == 4, "attention_dropout_mask",
              "expected the scores' shape [B, H, Tq, Tk], found {}", scores_shape);
  WEAVE_CHECK(p >= 0 && p < 1, "attention_dropout_mask", "p must be in [0, 1), found {}", p);
  const uint64_t seed = p > 0 ? draw_seed(generator) : 0;
  Tensor mask = empty(scores_shape, {.dtype = kBool});
  bool* m = mask.data<bool>();
  for (int64_t i = 0; i < mask.numel(); ++i)
    m[i] = p == 0 || functors::dropout_keep(seed, uint64_t(i), p);
  return mask;
}

}  // namespace weave

// scaled_dot_product_attention: checks, layouts and the autograd record around the fused
// kernels (kernels/cpu/attention.cpp, kernels/cuda/attention.cu).
#include <cmath>
#include <tuple>

#include "weave/ops/attention_blocks.h"
#include "weave/ops/autocast.h"
#include "weave/ops/captured_step.h"
#include "weave/ops/internal.h"

namespace weave {

using namespace detail;

namespace {

constexpr const char* kAttentionOp = "scaled_dot_product_attention";

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

/// Documents as the kernels take them, int64 [B, length] contiguous.
Tensor documents(const Tensor& ids, int64_t batch, int64_t length, const Tensor& q,
                 const char* what) {
  return per_position(ids, batch, length, q, kAttentionOp, what).contiguous();
}

/// The queries' and keys' documents of a packed batch into params (see AttentionOptions).
void prepare_documents(const Tensor& q, const Tensor& k, const AttentionOptions& options,
                       kernels::AttentionParams& params) {
  WEAVE_CHECK(options.document_ids.defined(), kAttentionOp,
              "query_document_ids is set but document_ids (the keys') is not; hint: pass both, "
              "or document_ids alone when the queries are the keys' last positions");
  const int64_t batch = q.size(0), tq = q.size(2), tk = k.size(2);
  params.key_documents = documents(options.document_ids, batch, tk, q, "document_ids");
  if (options.query_document_ids.defined()) {
    params.query_documents =
        documents(options.query_document_ids, batch, tq, q, "query_document_ids");
    return;
  }
  WEAVE_CHECK(tq <= tk, kAttentionOp,
              "{} queries but {} keys: the queries' documents are the keys' last Tq only when Tq "
              "<= Tk; hint: pass query_document_ids",
              tq, tk);
  params.query_documents = params.key_documents.narrow(1, tk - tq, tq).contiguous();
}

struct Checked {
  Tensor q, k, v, mask;
  kernels::AttentionParams params;
  DType out_dtype;
};

Checked check_and_prepare(const Tensor& q, const Tensor& k, const Tensor& v,
                          const AttentionOptions& options) {
  check_defined(q, kAttentionOp, "q");
  check_defined(k, kAttentionOp, "k");
  check_defined(v, kAttentionOp, "v");
  check_same_device(q, k, kAttentionOp);
  check_same_device(q, v, kAttentionOp);
  WEAVE_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, kAttentionOp,
              "expected q, k, v of shape [B, H, T, D], found {}, {} and {}; hint: a [B, T, H, D] "
              "projection becomes [B, H, T, D] with .transpose(1, 2)",
              q.shape(), k.shape(), v.shape());
  WEAVE_CHECK(q.size(0) == k.size(0) && q.size(0) == v.size(0), kAttentionOp,
              "q {}, k {} and v {} differ in batch size", q.shape(), k.shape(), v.shape());
  WEAVE_CHECK(k.size(1) == v.size(1) && k.size(1) > 0 && q.size(1) % k.size(1) == 0, kAttentionOp,
              "q {} has {} heads, k {} and v {} have {} and {}: k and v need one head count "
              "that divides q's (grouped-query attention shares each key/value head among "
              "q.size(1) / k.size(1) query heads)",
              q.shape(), q.size(1), k.shape(), v.shape(), k.size(1), v.size(1));
  WEAVE_CHECK(k.size(2) == v.size(2), kAttentionOp, "k {} and v {} differ in length", k.shape(),
              v.shape());
  WEAVE_CHECK(q.size(3) == k.size(3), kAttentionOp, "q {} and k {} differ in head size", q.shape(),
              k.shape());
  WEAVE_CHECK(q.dtype() == k.dtype() && q.dtype() == v.dtype() && is_floating(q.dtype()),
              kAttentionOp, "expected q, k, v of one floating dtype, found {}, {} and {}",
              q.dtype(), k.dtype(), v.dtype());
  WEAVE_CHECK(options.dropout_p >= 0 && options.dropout_p < 1, kAttentionOp,
              "dropout_p must be in [0, 1), found {}", options.dropout_p);
  const double scale =
      options.scale.value_or(1.0 / std::sqrt(double(std::max<int64_t>(q.size(3), 1))));
  WEAVE_CHECK(std::isfinite(scale), kAttentionOp, "scale must be finite, found {}", scale);
  WEAVE_CHECK(options.window >= 0 && (options.window == 0 || options.causal), kAttentionOp,
              "window {} needs causal = true and a size >= 0 (0: no window); hint: a sliding "
              "window counts the positions up to each query's own",
              options.window);
  WEAVE_CHECK(options.softcap >= 0 && std::isfinite(options.softcap), kAttentionOp,
              "softcap must be finite and >= 0 (0: none), found {}", options.softcap);
  Checked c;
  c.out_dtype = q.dtype();
  c.params.scale = scale;
  c.params.causal = options.causal;
  c.params.window = options.window;
  c.params.softcap = options.softcap;
  c.params.query_start = options.query_start;
  c.params.dropout_p = options.dropout_p;
  if (options.dropout_p > 0) {
    WEAVE_CHECK(!capturing_graph(q), kAttentionOp,
                "dropout draws its seed on the host, which a step captured in a CUDA graph "
                "cannot do (every replay would reuse one mask); hint: dropout_p = 0 in captured "
                "steps");
    c.params.dropout_seed = draw_seed(options.generator);
  }
  if (options.document_ids.defined() || options.query_document_ids.defined())
    prepare_documents(q, k, options, c.params);
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
    check_same_device(q, m, kAttentionOp);
    WEAVE_CHECK(m.dtype() == kBool || is_floating(m.dtype()), kAttentionOp,
                "expected a bool or floating mask, found {}", m.dtype());
    bool broadcasts = m.dim() <= 4;
    for (int d = 0; broadcasts && d < m.dim(); ++d) {
      const int64_t size = m.shape()[d], want = scores[4 - m.dim() + d];
      broadcasts = size == want || size == 1;
    }
    WEAVE_CHECK(broadcasts, kAttentionOp,
                "mask {} does not broadcast to the scores [B, H, Tq, Tk] = {}", m.shape(), scores);
    c.mask = broadcast_view(m.dtype() == kBool ? m : convert(m, dtype), scores);
  }
  return c;
}

/// The forward's kernels: `out` heads-last in the computation dtype, `lse` [B, H, Tq].
struct Forward {
  Checked c;
  Tensor out, lse;
};

Forward attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                          const AttentionOptions& options) {
  Forward f{check_and_prepare(q, k, v, options), {}, {}};
  const DType dtype = f.c.q.dtype();
  f.out = empty_heads_last(q.size(0), q.size(1), q.size(2), v.size(3), dtype, q.device());
  f.lse = empty_on({q.size(0), q.size(1), q.size(2)}, kernel_dtype(dtype), q.device());
  if (f.out.numel() > 0 || f.lse.numel() > 0) {
    if (k.size(2) == 0) {  // no key to attend to: every row is empty
      kernels::fill(f.out, 0);
      kernels::fill(f.lse, INFINITY);
    } else if (attention_by_blocks(f.c.q, f.c.k, f.c.mask, f.c.params)) {
      blocked_attention(f.c.q, f.c.k, f.c.v, f.c.params, f.out, f.lse);
    } else {
      kernels::attention(f.c.q, f.c.k, f.c.v, f.c.mask, f.c.params, f.out, f.lse);
    }
  }
  return f;
}

/// What backward keeps of a forward: its operands, output and log-sum-exp.
struct Saved {
  SavedTensor q, k, v, out;
  Tensor lse, mask;
  kernels::AttentionParams params;
};

/// P = softmax(S), S = scale q k^T:  dv = P^T g,  dS = P (g v^T - rowsum(g o)),
/// dq = scale dS k,  dk = scale dS^T q  (dropout's mask regenerated from its seed), written
/// into dq, dk, dv (any strides with a unit inner one) and dmask when defined.
void attention_grads(const Saved& s, const Tensor& grad, const Tensor& dq, const Tensor& dk,
                     const Tensor& dv, const Tensor& dmask) {
  Tensor qv = s.q.unpack(), kv = s.k.unpack(), vv = s.v.unpack();
  Tensor g = operand(grad, qv.dtype());
  if (kv.size(2) == 0) {
    for (const Tensor& t : {dq, dk, dv}) kernels::fill(t, 0);
    if (dmask.defined()) kernels::fill(dmask, 0);
  } else if (dq.numel() == 0 && dk.numel() == 0) {
    return;
  } else if (!dmask.defined() && attention_by_blocks(qv, kv, s.mask, s.params)) {
    blocked_attention_backward(g, qv, kv, vv, s.params, s.out.unpack(), s.lse, dq, dk, dv);
  } else {
    kernels::attention_backward(g, qv, kv, vv, s.mask, s.params, s.out.unpack(), s.lse, dq, dk, dv,
                                dmask);
  }
}

/// A gradient buffer for operand t: contiguous where t is (AccumulateGrad then keeps the buffer
/// as the leaf's .grad instead of copying it into place), heads-last otherwise (where a
/// [B, T, H, D] projection's transpose gets its gradient as a view).
Tensor empty_gradient_for(const Tensor& t) {
  if (t.is_contiguous()) return empty_on(t.shape(), t.dtype(), t.device());
  return empty_heads_last(t.size(0), t.size(1), t.size(2), t.size(3), t.dtype(), t.device());
}

}  // namespace

AttentionResult scaled_dot_product_attention_with_lse(const Tensor& q, const Tensor& k,
                                                      const Tensor& v,
                                                      const AttentionOptions& options) {
  if (autocast_dtype()) {
    Tensor qc = autocast_input(q, kAttentionOp, "q"), kc = autocast_input(k, kAttentionOp, "k");
    Tensor vc = autocast_input(v, kAttentionOp, "v");
    if (!qc.is_same(q) || !kc.is_same(k) || !vc.is_same(v))
      return scaled_dot_product_attention_with_lse(qc, kc, vc, options);
  }
  Forward f = attention_forward(q, k, v, options);
  // An additive mask that requires grad (a learned position bias) gets dS, summed over the
  // dims it was broadcast along; only then is a Tq x Tk gradient formed.
  const Tensor& mask_input = options.mask;
  const bool mask_grad = mask_input.defined() && mask_input.dtype() != kBool;
  Tensor output = autograd::record(
      "ScaledDotProductAttentionBackward", {q, k, v, mask_grad ? mask_input : Tensor()},
      convert(f.out, f.c.out_dtype), [&] {
        return [s = Saved{SavedTensor(f.c.q), SavedTensor(f.c.k), SavedTensor(f.c.v),
                          SavedTensor(f.out), f.lse, f.c.mask, f.c.params},
                qi = InputInfo(q), ki = InputInfo(k), vi = InputInfo(v),
                mi = InputInfo(mask_input)](const BackwardArgs& args) -> Grads {
          Tensor qv = s.q.unpack(), kv = s.k.unpack();
          Tensor dq = empty_gradient_for(qv), dk = empty_gradient_for(kv);
          Tensor dv = empty_gradient_for(s.v.unpack());
          Tensor dmask = args.needs(3) ? empty_on({qv.size(0), qv.size(1), qv.size(2), kv.size(2)},
                                                  qv.dtype(), qv.device())
                                       : Tensor();
          attention_grads(s, args.grad(), dq, dk, dv, dmask);
          return {convert(dq, qi.dtype), convert(dk, ki.dtype), convert(dv, vi.dtype),
                  dmask.defined() ? reduce_grad(dmask, mi) : Tensor()};
        };
      });
  return {output, f.lse};
}

AttentionGrads scaled_dot_product_attention_backward(const Tensor& grad, const Tensor& q,
                                                     const Tensor& k, const Tensor& v,
                                                     const Tensor& output, const Tensor& logsumexp,
                                                     const AttentionOptions& options) {
  constexpr const char* op = "scaled_dot_product_attention_backward";
  WEAVE_CHECK(options.dropout_p == 0, op,
              "dropout_p is {}, but a dropout mask is regenerated only inside the op's own "
              "backward; hint: call scaled_dot_product_attention and let autograd differentiate",
              options.dropout_p);
  const Checked c = check_and_prepare(q, k, v, options);
  const Shape rows{q.size(0), q.size(1), q.size(2)},
      out_shape{rows[0], rows[1], rows[2], v.size(3)};
  for (const auto& [t, what, want] :
       {std::tuple{&grad, "grad", out_shape}, std::tuple{&output, "output", out_shape},
        std::tuple{&logsumexp, "logsumexp", rows}}) {
    check_defined(*t, op, what);
    check_same_device(q, *t, op);
    WEAVE_CHECK(t->shape() == want, op, "expected {} of shape {}, found {}", what, want,
                t->shape());
  }
  const DType dtype = c.q.dtype();
  const Saved s{SavedTensor(c.q),
                SavedTensor(c.k),
                SavedTensor(c.v),
                SavedTensor(operand(output, dtype)),
                convert(logsumexp, kernel_dtype(dtype)).contiguous(),
                c.mask,
                c.params};
  Tensor dq = empty_gradient_for(c.q), dk = empty_gradient_for(c.k);
  Tensor dv = empty_gradient_for(c.v);
  attention_grads(s, grad, dq, dk, dv, Tensor());
  return {convert(dq, q.dtype()), convert(dk, k.dtype()), convert(dv, v.dtype())};
}

Tensor packed_qkv_attention(const Tensor& qkv, const AttentionOptions& options) {
  check_defined(qkv, kAttentionOp, "qkv");
  WEAVE_CHECK(qkv.dim() == 5 && qkv.size(3) == 3, kAttentionOp,
              "expected packed qkv [B, T, H, 3, D], found {}; hint: a fused projection's output "
              "[B, T, H * 3 * D] reshapes to it",
              qkv.shape());
  if (Tensor c = autocast_input(qkv, kAttentionOp, "qkv"); !c.is_same(qkv))
    return packed_qkv_attention(c, options);
  auto part = [](const Tensor& packed, int64_t i) { return packed.select(3, i).transpose(1, 2); };
  if (options.mask.defined() && options.mask.requires_grad())  // dS goes to the mask as well
    return scaled_dot_product_attention(part(qkv, 0), part(qkv, 1), part(qkv, 2), options);
  const Tensor values = qkv.detach();
  Forward f = attention_forward(part(values, 0), part(values, 1), part(values, 2), options);
  // One node for the three views: their gradients land in one packed buffer, written once,
  // instead of three zero-filled buffers of qkv's size summed by the engine.
  return autograd::record("PackedQKVAttentionBackward", {qkv}, convert(f.out, f.c.out_dtype), [&] {
    return [s = Saved{SavedTensor(f.c.q), SavedTensor(f.c.k), SavedTensor(f.c.v),
                      SavedTensor(f.out), f.lse, f.c.mask, f.c.params},
            in = InputInfo(qkv), part](const BackwardArgs& args) -> Grads {
      Tensor qv = s.q.unpack();
      Tensor dqkv = empty_on(in.shape, qv.dtype(), qv.device());
      attention_grads(s, args.grad(), part(dqkv, 0), part(dqkv, 1), part(dqkv, 2), Tensor());
      return {convert(dqkv, in.dtype)};
    };
  });
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

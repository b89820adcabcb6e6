#pragma once
// Kernel entry points (internal). Each dispatches on device (cpu/ or cuda/), then on dtype.
// Callers (the op front ends) have already checked arguments, allocated `out`, broadcast the
// inputs to out's shape (stride-0 views) and converted them to the computation dtype.
#include <cstdint>
#include <optional>
#include <vector>

#include "weave/kernels/attention_rules.h"
#include "weave/kernels/functors.h"
#include "weave/tensor/tensor.h"

namespace weave::kernels {

enum class UnaryOp : uint8_t {
#define WEAVE_ENUM(Name, Functor, fn) Name,
  WEAVE_UNARY_OPS(WEAVE_ENUM)
#undef WEAVE_ENUM
};

enum class BinaryOp : uint8_t {
#define WEAVE_ENUM(Name, Functor) Name,
  WEAVE_ARITHMETIC_OPS(WEAVE_ENUM) WEAVE_COMPARISON_OPS(WEAVE_ENUM)
#undef WEAVE_ENUM
};

inline bool is_comparison(BinaryOp op) {
  return op >= BinaryOp::Eq;
}

/// visit_dtype over the dtypes arithmetic is defined on (all but bool).
template <class Fn>
void visit_arithmetic(DType dtype, const char* op, Fn&& fn) {
  WEAVE_CHECK(dtype != kBool, op, "expected a numeric dtype, found bool; hint: .to(kInt64)");
  visit_dtype(dtype, [&](auto tag) {
    if constexpr (!std::is_same_v<typename decltype(tag)::type, bool>) fn(tag);
  });
}

/// Calls fn(type_tag<float>{}) or fn(type_tag<double>{}); any other dtype raises naming op.
template <class Fn>
void visit_floating(DType dtype, const char* op, Fn&& fn) {
  if (dtype == kFloat32) return fn(type_tag<float>{});
  if (dtype == kFloat64) return fn(type_tag<double>{});
  WEAVE_FAIL(op, "expected float32 or float64, found {}", dtype);
}

/// Calls fn(type_tag<P>{}) for the parameter dtypes the fused optimizer kernels take: float32,
/// float64, and bfloat16 / float16 (whose state is float32: compute_t<P>); others raise.
template <class Fn>
void visit_param_dtype(DType dtype, const char* op, Fn&& fn) {
  if (dtype == kBFloat16) return fn(type_tag<BFloat16>{});
  if (dtype == kFloat16) return fn(type_tag<Half>{});
  visit_floating(dtype, op, fn);
}

/// visit_arithmetic restricted to the dtypes unary op Functor is instantiated for: floating
/// only, unless the op is defined on integers.
template <class Functor, class Fn>
void visit_unary(DType dtype, const char* op, Fn&& fn) {
  visit_arithmetic(dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (Functor::integral || std::is_floating_point_v<compute_t<T>>) {
      fn(tag);
    } else {
      WEAVE_FAIL(op, "expected a floating dtype, found {}", dtype);
    }
  });
}

/// bias_activation's dtypes for activation Functor: the GELUs (bias_gelu, a linear's epilogue)
/// in every floating dtype, so that autocast's bfloat16 takes no conversion pass; any other
/// activation in float32 and float64 only (a kernel per dtype and activation otherwise).
template <class Functor, class Fn>
void visit_bias_activation(DType dtype, const char* op, Fn&& fn) {
  if constexpr (std::is_same_v<Functor, functors::Gelu> ||
                std::is_same_v<Functor, functors::GeluTanh>)
    visit_param_dtype(dtype, op, fn);
  else
    visit_floating(dtype, op, fn);
}

/// Calls fn(type_tag<Functor>{}, name) with the functor that implements a unary op.
template <class Fn>
void visit_unary_op(UnaryOp op, Fn&& fn) {
  switch (op) {
#define WEAVE_CASE(Name, Functor, function) \
  case UnaryOp::Name:                       \
    return fn(type_tag<Functor>{}, #function);
    WEAVE_UNARY_OPS(WEAVE_CASE)
#undef WEAVE_CASE
  }
}

/// Calls fn(type_tag<Functor>{}, name) with the functor that implements a binary op.
template <class Fn>
void visit_binary_op(BinaryOp op, Fn&& fn) {
  switch (op) {
#define WEAVE_CASE(Name, Functor) \
  case BinaryOp::Name:            \
    return fn(type_tag<Functor>{}, #Name);
    WEAVE_ARITHMETIC_OPS(WEAVE_CASE) WEAVE_COMPARISON_OPS(WEAVE_CASE)
#undef WEAVE_CASE
  }
}

/// True for the binary functors that return bool.
template <class Functor>
inline constexpr bool kComparison = std::is_same_v<decltype(Functor{}(1, 1)), bool>;

enum class ReduceOp : uint8_t { Sum, Max, Min, ArgMax, ArgMin };

/// float32 matmul on CUDA: Highest keeps float32 throughout; High lets cuBLAS use TF32 tensor
/// cores (10-bit mantissa inputs, float32 accumulation). The CPU always computes float32.
enum class Float32MatmulPrecision : uint8_t { Highest, High };
void set_float32_matmul_precision(Float32MatmulPrecision precision);
Float32MatmulPrecision float32_matmul_precision();

/// The CPU kernels' thread budget, one value for the whole process (OpenMP's own setting
/// belongs to each calling thread, so a communication worker would otherwise use every core).
void set_max_threads(int threads);
int max_threads();

/// out = op(x); x and out have one dtype.
void unary(UnaryOp op, const Tensor& x, const Tensor& out);
/// out = grad * op'(x) where y = op(x).
void unary_backward(UnaryOp op, const Tensor& grad, const Tensor& x, const Tensor& y,
                    const Tensor& out);
/// out = op(a, b); a and b share a dtype; out has it too, or bool for comparisons.
void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out);
/// out = self + value * a * b (or a / b with divide); one floating dtype, one shape (inputs
/// may be broadcast views).
void addcmul(const Tensor& self, const Tensor& a, const Tensor& b, double value, bool divide,
             const Tensor& out);
/// out = self + weight * (end - self).
void lerp(const Tensor& self, const Tensor& end, double weight, const Tensor& out);
/// out = cond ? a : b; cond is bool.
void where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out);
/// dst = src elementwise, converting dtype, across devices.
void copy(const Tensor& src, const Tensor& dst);
void fill(const Tensor& dst, double value);
/// x is contiguous and viewed as [outer, reduced, inner]; out is [outer, inner] (contiguous).
/// ArgMax/ArgMin write int64 indices into the reduced dimension.
void reduce(ReduceOp op, const Tensor& x, int64_t outer, int64_t reduced, int64_t inner,
            const Tensor& out);
/// out[b] = a[b] @ b[b] for 3-D a [B, M, K], b [B, K, N] (a row- or column-major inner
/// layout, batch stride may be 0) into contiguous out [B, M, N]; with accumulate, out[b] +=
/// (GEMM's beta = 1: a bias placed in out first costs no extra pass).
void matmul(const Tensor& a, const Tensor& b, const Tensor& out, bool accumulate = false);
/// src contiguous viewed as [outer, n, inner]; out[o, i, :] = src[o, index[i], :].
void index_select(const Tensor& src, int64_t outer, int64_t n, int64_t inner, const Tensor& index,
                  const Tensor& out);
/// dst contiguous viewed as [outer, n, inner]; dst[o, index[i], :] += src[o, i, :].
void index_add(const Tensor& dst, int64_t outer, int64_t n, int64_t inner, const Tensor& index,
               const Tensor& src);
/// out[t] = sum_j weight[t, j] rows[index[t, j]] (j in order; a negative index adds nothing):
/// rows [R, H], int64 index and weight [T, K], out [T, H], contiguous, float32 or float64.
void gather_weighted_sum(const Tensor& rows, const Tensor& index, const Tensor& weight,
                         const Tensor& out);
/// Its gradients from grad [T, H]: d_rows [R, H] = sum over (t, j) with index[t, j] = r of
/// weight[t, j] grad[t] (zero where no index points), d_weight[t, j] = grad[t] . rows[index[t, j]]
/// (0 at a negative index).
void gather_weighted_sum_backward(const Tensor& grad, const Tensor& rows, const Tensor& index,
                                  const Tensor& weight, const Tensor& d_rows,
                                  const Tensor& d_weight);

// ---- fused neural-network kernels --------------------------------------------------------
// Row kernels take contiguous tensors viewed as [rows, n] (n: the last dim's size) in one
// floating dtype; per-row statistics ([rows]) are in that dtype too.

/// out = softmax of each row, or log_softmax with `log`.
void softmax(const Tensor& x, const Tensor& out, bool log);
/// The gradient from the forward's output y: y (g - sum(g y)), or g - exp(y) sum(g) with `log`.
void softmax_backward(const Tensor& grad, const Tensor& y, const Tensor& out, bool log);
/// Normalizes each row, then scales and shifts by weight and bias [n] (either undefined):
/// layer norm (x - mean) rstd, or with `rms` x rstd (rstd = 1 / sqrt(mean(x^2) + eps)).
/// Writes mean (layer norm only) and rstd per row for the backward.
void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, bool rms,
                const Tensor& out, const Tensor& mean, const Tensor& rstd);
/// dx from the saved statistics; dweight and dbias [n] (sums over rows) where defined.
void layer_norm_backward(const Tensor& grad, const Tensor& x, const Tensor& weight,
                         const Tensor& mean, const Tensor& rstd, bool rms, const Tensor& dx,
                         const Tensor& dweight, const Tensor& dbias);
/// loss[i] = logsumexp(logits[i]) - logits[i, target[i]] (0 where target is ignore_index);
/// target is int64 [rows]; writes lse [rows]. Targets are checked by the caller.
void cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                   const Tensor& loss, const Tensor& lse);
/// dlogits[i] = grad[i] (softmax(logits[i]) - onehot(target[i])), recomputed from lse.
void cross_entropy_backward(const Tensor& grad, const Tensor& logits, const Tensor& target,
                            int64_t ignore_index, const Tensor& lse, const Tensor& dlogits);
/// out = op(x + bias) elementwise in one pass (bias: a broadcast view of out's shape).
void bias_activation(UnaryOp op, const Tensor& x, const Tensor& bias, const Tensor& out);
/// out = grad op'(x + bias), recomputing op(x + bias) where the derivative needs it.
void bias_activation_backward(UnaryOp op, const Tensor& grad, const Tensor& x, const Tensor& bias,
                              const Tensor& out);
/// out = op(gate) up elementwise in one pass (gate and up: views of one fused projection).
void gated_activation(UnaryOp op, const Tensor& gate, const Tensor& up, const Tensor& out);
/// dgate = grad up op'(gate), dup = grad op(gate) (two passes, into views of one buffer).
void gated_activation_backward(UnaryOp op, const Tensor& grad, const Tensor& gate, const Tensor& up,
                               const Tensor& dgate, const Tensor& dup);

/// Fused attention's settings. Causal masking is aligned to the bottom right: query i of Tq
/// sits at position i + Tk - Tq and sees keys up to there (the usual rule for cached decoding;
/// the ordinary causal mask when Tq == Tk).
struct AttentionParams {
  double scale = 1.0;
  bool causal = false;
  /// Position of query 0 counted from key 0; Tk - Tq (bottom right) when unset.
  std::optional<int64_t> query_start{};
  /// Sliding window (with causal): each query sees its `window` latest keys; 0 = all.
  int64_t window = 0;
  /// Soft-capped scores: cap tanh(scale q k / cap) before the mask (0 = none).
  double softcap = 0;
  double dropout_p = 0.0;
  uint64_t dropout_seed = 0;  // functors::dropout_keep's seed for this call
  /// Packed sequences (both or neither): int64 [B, Tq] and [B, Tk] contiguous on q's device;
  /// query i sees key j only where their documents are equal.
  Tensor query_documents{}, key_documents{};
};
/// The keys each of tq queries sees among tk under params' causal rule and window.
inline functors::KeyRange key_range(const AttentionParams& params, int64_t tq, int64_t tk) {
  return {params.causal, params.query_start.value_or(tk - tq), params.window, tq, tk};
}
/// out [B, H, Tq, Dv] = softmax(scale q k^T + mask) v for q [B, H, Tq, D], k [B, Hkv, Tk, D],
/// v [B, Hkv, Tk, Dv] (query head h reads key/value head h / (H / Hkv)), each with unit stride
/// in its last dim and any other strides; mask is
/// undefined or a broadcast view [B, H, Tq, Tk] (bool: true attends; else additive, q's
/// dtype). lse [B, H, Tq] contiguous gets each row's log-sum-exp (+inf for a row that attends
/// to nothing, whose output is 0). Never holds a Tq x Tk tensor.
void attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
               const AttentionParams& params, const Tensor& out, const Tensor& lse);
/// True where `attention` on q's device computes in q's own bfloat16/float16 (CUDA tensor
/// cores; no mask, no dropout, head size 64 or 128; document ids and grouped-query heads
/// allowed). The op then passes q, k, v, out and grads
/// in that dtype, with rows that attention_rows_aligned accepts, and lse in float32.
bool attention_takes_reduced(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                             const AttentionParams& params);
/// True where t's rows suit the tensor-core kernels (16-byte aligned, strides multiples of 8).
bool attention_rows_aligned(const Tensor& t);
/// dq, dk, dv (shaped like q, k, v, unit inner stride) from the forward's out and lse
/// (contiguous, as forward wrote it),
/// recomputing the scores block by block; dmask (contiguous [B, H, Tq, Tk], or undefined)
/// gets the gradient of the scores, for an additive mask that requires grad.
void attention_backward(const Tensor& grad, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& mask, const AttentionParams& params, const Tensor& out,
                        const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                        const Tensor& dmask);

/// out [B, T, H, D] = x [B, T, H, D] with each dim pair turned by position * frequency
/// (interleaved: pairs (2i, 2i + 1), else (i, i + R / 2)), or by minus that when `inverse` (the
/// backward); dims from R = 2 * frequencies.numel() on are copied. x and out have unit stride
/// in D and any others, and may be the same tensor; positions is int64 [B, T] (any strides),
/// frequencies float64 [R / 2] contiguous, both on x's device.
void rotary(const Tensor& x, const Tensor& positions, const Tensor& frequencies, bool interleaved,
            bool inverse, const Tensor& out);

// Blocked attention's row passes (ops/attention_blocks.cpp), over the scores s [n, Tq, Tk]
// (contiguous) of one block of heads; query i sees the keys key_range(params, Tq, Tk) gives it
// (at least one: the caller sends no row that sees none). lse and delta are [n, Tq],
// contiguous, in s's dtype.

/// s = softmax(softcap(scale s)) over the keys each row sees (0 elsewhere), in place; lse gets
/// each row's log-sum-exp of the capped scores.
void attention_softmax(const Tensor& s, const AttentionParams& params, const Tensor& lse);
/// s = exp(softcap(scale s) - lse) where the row sees the key, 0 elsewhere, in place (the
/// forward's probabilities again); with a soft-cap, capped (like s, or undefined without one)
/// gets the capped scores, for attention_score_grad.
void attention_probs(const Tensor& s, const AttentionParams& params, const Tensor& lse,
                     const Tensor& capped);
/// dp = scale p (dp - delta) in place, times softcap_grad(capped) when capped is defined: the
/// raw scores' gradient, scaled for dq and dk.
void attention_score_grad(const Tensor& dp, const Tensor& p, const Tensor& delta, double scale,
                          const Tensor& capped, double softcap);

/// The constants of one Adam/AdamW step (correction1/2: 1 - beta1^t, 1 - beta2^t).
struct AdamStep {
  double lr, beta1, beta2, eps, weight_decay, correction1, correction2;
  bool decoupled;  // AdamW: p *= 1 - lr * wd; Adam: g += wd * p
  /// When set: {lr, correction1, correction2} on the parameters' device (adam_advance's scalars
  /// + 1), read there when the update runs instead of the fields above, so that a replayed CUDA
  /// graph steps with each replay's numbers.
  const double* scalars = nullptr;
};
/// A capturable Adam's per-step numbers, kept where its parameters are: scalars is float64 [4]
/// = {step, lr, 1 - beta1^step, 1 - beta2^step}; counts the step and recomputes the corrections
/// on that device, with no value passing through the host.
void adam_advance(const Tensor& scalars, double beta1, double beta2);
/// One fused Adam update, in place, in a single pass over contiguous tensors on one device: param
/// and grad of one floating dtype, the state in its compute dtype (float32 for bfloat16/float16
/// parameters, each rounded once per step): m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
/// p -= lr / c1 * m / (sqrt(v / c2) + eps).
void adam_update(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                 const Tensor& exp_avg_sq, const AdamStep& step);

/// One parameter's tensors for adam_update_many (as adam_update takes them) and its decay.
struct AdamTensors {
  Tensor param, grad, exp_avg, exp_avg_sq;
  double weight_decay = 0;
};
/// adam_update for every entry (all on one device), each with its own weight decay
/// (step.weight_decay is not read); CUDA updates many parameters per launch.
void adam_update_many(const std::vector<AdamTensors>& tensors, const AdamStep& step);

/// Over every element of every tensor in xs (contiguous, floating, all on out's device): the
/// sum of |x|^p accumulated in float64, or with p infinite the largest |x| (NaN where any is),
/// into the float64 scalar `out`. CUDA reads many tensors per launch and folds the parts in a
/// fixed order, so a result has the same bits on every run.
void norm_power_sum(const std::vector<Tensor>& xs, double p, const Tensor& out);
/// x *= scale in place (in x's compute dtype) for every tensor in xs (contiguous, floating,
/// one device); CUDA scales many tensors per launch.
void scale_many(const std::vector<Tensor>& xs, double scale);
/// Clipping where the tensors live, the host reading nothing: norm (float64 [2]) gets {total,
/// coefficient} from the float64 scalar power_sum (norm_power_sum's): total = power_sum^(1/p)
/// (power_sum itself for p infinite), coefficient = max_norm / (total + 1e-6) where that is
/// below 1 or NaN, else 1; then every x *= coefficient, as scale_many.
void clip_many(const std::vector<Tensor>& xs, const Tensor& power_sum, double p, double max_norm,
               const Tensor& norm);

/// Binned sums (common/binned.h), one per element, whose bits do not depend on the order of the
/// additions: adds every element of x (floating, contiguous, n elements) into the sums
/// `window` (uint8 [n]) and `limbs` (int64 [n, 2]), all on one device.
void binned_add(const Tensor& x, const Tensor& window, const Tensor& limbs);
/// Moves every sum up to the window `to` (uint8 [n], each at least the sum's own: the largest
/// over the ranks), so that sums of several ranks add as integers.
void binned_raise(const Tensor& window, const Tensor& limbs, const Tensor& to);
/// out (floating [n]) = each sum / divisor, rounded once into out's dtype from a double.
void binned_value(const Tensor& window, const Tensor& limbs, double divisor, const Tensor& out);
/// Adds the sum of |x|^p (each power rounded to a double, then added exactly) over every
/// element of xs into the exact limbs (int64 [common::kExactLimbs + 1]) and normalizes them;
/// the last word counts the threads' ranges that met a NaN or infinite power.
void exact_power_sum(const std::vector<Tensor>& xs, double p, const Tensor& limbs);

struct SgdStep {
  double lr, momentum, dampening, weight_decay;
  bool nesterov;
  bool first;  // the momentum buffer takes the gradient as is (PyTorch's first step)
};
/// One fused SGD update, in place, in a single pass over contiguous tensors on one device (dtypes
/// as adam_update's): g += wd p; buf = momentum buf + (1 - dampening) g (or g at first);
/// p -= lr (nesterov ? g + momentum buf : buf). momentum_buffer is ignored without momentum.
void sgd_update(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer,
                const SgdStep& step);

}  // namespace weave::kernels

// Device dispatch for every kernel entry point.
#include "weave/kernels/kernels.h"

#include <omp.h>

#include <atomic>

#include "weave/kernels/backends.h"
#include "weave/tensor/cuda/device_runtime.h"
#include "weave/tensor/trace.h"

namespace weave::kernels {

namespace {
std::atomic<int>& thread_budget() {
  static std::atomic<int> threads{omp_get_max_threads()};  // OMP_NUM_THREADS, or the cores
  return threads;
}
}  // namespace

namespace {
std::atomic<Float32MatmulPrecision> matmul_precision{Float32MatmulPrecision::Highest};
}  // namespace

void set_float32_matmul_precision(Float32MatmulPrecision precision) {
  matmul_precision.store(precision, std::memory_order_relaxed);
}
Float32MatmulPrecision float32_matmul_precision() {
  return matmul_precision.load(std::memory_order_relaxed);
}

void set_max_threads(int threads) {
  thread_budget().store(threads, std::memory_order_relaxed);
}
int max_threads() {
  return thread_budget().load(std::memory_order_relaxed);
}

namespace {
bool on_cuda(const Tensor& t) {
  return t.device().is_cuda();
}
}  // namespace

const char* unary_name(UnaryOp op) {
  const char* name = "unary";
  visit_unary_op(op, [&](auto, const char* n) { name = n; });
  return name;
}
const char* binary_name(BinaryOp op) {
  const char* name = "binary";
  visit_binary_op(op, [&](auto, const char* n) { name = n; });
  return name;
}

// Every kernel call is an "op" event of the trace (weave/tensor/trace.h).
#define WEAVE_DISPATCH(name, call)            \
  const trace::Scope trace_scope("op", name); \
  if (on_cuda(out)) return cuda::call;        \
  return cpu::call

void unary(UnaryOp op, const Tensor& x, const Tensor& out) {
  WEAVE_DISPATCH(unary_name(op), unary(op, x, out));
}

void unary_backward(UnaryOp op, const Tensor& grad, const Tensor& x, const Tensor& y,
                    const Tensor& out) {
  WEAVE_DISPATCH(unary_name(op), unary_backward(op, grad, x, y, out));
}

void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  WEAVE_DISPATCH(binary_name(op), binary(op, a, b, out));
}

void where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) {
  WEAVE_DISPATCH("where", where(cond, a, b, out));
}

void fill(const Tensor& out, double value) {
  WEAVE_DISPATCH("fill", fill(out, value));
}

void reduce(ReduceOp op, const Tensor& x, int64_t outer, int64_t reduced, int64_t inner,
            const Tensor& out) {
  WEAVE_DISPATCH("reduce", reduce(op, x, outer, reduced, inner, out));
}

void matmul(const Tensor& a, const Tensor& b, const Tensor& out, bool accumulate) {
  WEAVE_DISPATCH("matmul", matmul(a, b, out, accumulate));
}

void index_select(const Tensor& src, int64_t outer, int64_t n, int64_t inner, const Tensor& index,
                  const Tensor& out) {
  WEAVE_DISPATCH("index_select", index_select(src, outer, n, inner, index, out));
}

void index_add(const Tensor& out, int64_t outer, int64_t n, int64_t inner, const Tensor& index,
               const Tensor& src) {
  WEAVE_DISPATCH("index_add", index_add(out, outer, n, inner, index, src));
}

void gather_weighted_sum(const Tensor& rows, const Tensor& index, const Tensor& weight,
                         const Tensor& out) {
  WEAVE_DISPATCH("gather_weighted_sum", gather_weighted_sum(rows, index, weight, out));
}

void gather_weighted_sum_backward(const Tensor& grad, const Tensor& rows, const Tensor& index,
                                  const Tensor& weight, const Tensor& d_rows,
                                  const Tensor& d_weight) {
  const Tensor& out = d_rows;
  WEAVE_DISPATCH("gather_weighted_sum_backward",
                 gather_weighted_sum_backward(grad, rows, index, weight, d_rows, d_weight));
}

void adam_update(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                 const Tensor& exp_avg_sq, const AdamStep& step) {
  const Tensor& out = param;
  WEAVE_DISPATCH("adam_update", adam_update(param, grad, exp_avg, exp_avg_sq, step));
}

void addcmul(const Tensor& self, const Tensor& a, const Tensor& b, double value, bool divide,
             const Tensor& out) {
  WEAVE_DISPATCH(divide ? "addcdiv" : "addcmul", addcmul(self, a, b, value, divide, out));
}

void lerp(const Tensor& self, const Tensor& end, double weight, const Tensor& out) {
  WEAVE_DISPATCH("lerp", lerp(self, end, weight, out));
}

void sgd_update(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer,
                const SgdStep& step) {
  const Tensor& out = param;
  WEAVE_DISPATCH("sgd_update", sgd_update(param, grad, momentum_buffer, step));
}

void adam_update_many(const std::vector<AdamTensors>& tensors, const AdamStep& step) {
  if (tensors.empty()) return;
  const Tensor& out = tensors.front().param;
  WEAVE_DISPATCH("adam_update", adam_update_many(tensors, step));
}

void norm_power_sum(const std::vector<Tensor>& xs, double p, const Tensor& out) {
  WEAVE_DISPATCH("norm_power_sum", norm_power_sum(xs, p, out));
}

void scale_many(const std::vector<Tensor>& xs, double scale) {
  if (xs.empty()) return;
  const Tensor& out = xs.front();
  WEAVE_DISPATCH("scale_many", scale_many(xs, scale));
}

void binned_add(const Tensor& x, const Tensor& window, const Tensor& limbs) {
  const Tensor& out = window;
  WEAVE_DISPATCH("binned_add", binned_add(x, window, limbs));
}

void binned_raise(const Tensor& window, const Tensor& limbs, const Tensor& to) {
  const Tensor& out = window;
  WEAVE_DISPATCH("binned_raise", binned_raise(window, limbs, to));
}

void binned_value(const Tensor& window, const Tensor& limbs, double divisor, const Tensor& out) {
  WEAVE_DISPATCH("binned_value", binned_value(window, limbs, divisor, out));
}

void exact_power_sum(const std::vector<Tensor>& xs, double p, const Tensor& limbs) {
  const Tensor& out = limbs;
  WEAVE_DISPATCH("exact_power_sum", exact_power_sum(xs, p, limbs));
}

void clip_many(const std::vector<Tensor>& xs, const Tensor& power_sum, double p, double max_norm,
               const Tensor& norm) {
  const Tensor& out = norm;
  WEAVE_DISPATCH("clip_many", clip_many(xs, power_sum, p, max_norm, norm));
}

void adam_advance(const Tensor& scalars, double beta1, double beta2) {
  const Tensor& out = scalars;
  WEAVE_DISPATCH("adam_advance", adam_advance(scalars, beta1, beta2));
}

void attention_softmax(const Tensor& s, const AttentionParams& params, const Tensor& lse) {
  const Tensor& out = s;
  WEAVE_DISPATCH("attention_softmax", attention_softmax(s, params, lse));
}

void attention_probs(const Tensor& s, const AttentionParams& params, const Tensor& lse,
                     const Tensor& capped) {
  const Tensor& out = s;
  WEAVE_DISPATCH("attention_probs", attention_probs(s, params, lse, capped));
}

void attention_score_grad(const Tensor& dp, const Tensor& p, const Tensor& delta, double scale,
                          const Tensor& capped, double softcap) {
  const Tensor& out = dp;
  WEAVE_DISPATCH("attention_score_grad",
                 attention_score_grad(dp, p, delta, scale, capped, softcap));
}

void softmax(const Tensor& x, const Tensor& out, bool log) {
  WEAVE_DISPATCH(log ? "log_softmax" : "softmax", softmax(x, out, log));
}

void softmax_backward(const Tensor& grad, const Tensor& y, const Tensor& out, bool log) {
  WEAVE_DISPATCH(log ? "log_softmax_backward" : "softmax_backward",
                 softmax_backward(grad, y, out, log));
}

void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, bool rms,
                const Tensor& out, const Tensor& mean, const Tensor& rstd) {
  WEAVE_DISPATCH(rms ? "rms_norm" : "layer_norm",
                 layer_norm(x, weight, bias, eps, rms, out, mean, rstd));
}

void layer_norm_backward(const Tensor& grad, const Tensor& x, const Tensor& weight,
                         const Tensor& mean, const Tensor& rstd, bool rms, const Tensor& dx,
                         const Tensor& dweight, const Tensor& dbias) {
  const Tensor& out = x;  // (dx is undefined when only the scale and shift need gradients)
  WEAVE_DISPATCH(rms ? "rms_norm_backward" : "layer_norm_backward",
                 layer_norm_backward(grad, x, weight, mean, rstd, rms, dx, dweight, dbias));
}

void cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                   const Tensor& loss, const Tensor& lse) {
  const Tensor& out = loss;
  WEAVE_DISPATCH("cross_entropy", cross_entropy(logits, target, ignore_index, loss, lse));
}

void cross_entropy_backward(const Tensor& grad, const Tensor& logits, const Tensor& target,
                            int64_t ignore_index, const Tensor& lse, const Tensor& dlogits) {
  const Tensor& out = dlogits;
  WEAVE_DISPATCH("cross_entropy_backward",
                 cross_entropy_backward(grad, logits, target, ignore_index, lse, dlogits));
}

void bias_activation(UnaryOp op, const Tensor& x, const Tensor& bias, const Tensor& out) {
  WEAVE_DISPATCH(unary_name(op), bias_activation(op, x, bias, out));
}

void bias_activation_backward(UnaryOp op, const Tensor& grad, const Tensor& x, const Tensor& bias,
                              const Tensor& out) {
  WEAVE_DISPATCH(unary_name(op), bias_activation_backward(op, grad, x, bias, out));
}

void gated_activation(UnaryOp op, const Tensor& gate, const Tensor& up, const Tensor& out) {
  WEAVE_DISPATCH(unary_name(op), gated_activation(op, gate, up, out));
}

void gated_activation_backward(UnaryOp op, const Tensor& grad, const Tensor& gate, const Tensor& up,
                               const Tensor& dgate, const Tensor& dup) {
  const Tensor& out = dgate;
  WEAVE_DISPATCH(unary_name(op), gated_activation_backward(op, grad, gate, up, dgate, dup));
}

namespace {
// Every backend indexes lse as a contiguous [B, H, Tq] block; a strided view would be read as
// another row's values.
void check_lse(const Tensor& lse, const char* op) {
  WEAVE_CHECK(lse.is_contiguous(), op,
              "internal: lse {} must be contiguous, found strides {}; hint: pass .contiguous()",
              lse.shape(), lse.strides());
}
}  // namespace

void attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
               const AttentionParams& params, const Tensor& out, const Tensor& lse) {
  check_lse(lse, "attention");
  WEAVE_DISPATCH("attention", attention(q, k, v, mask, params, out, lse));
}

void attention_backward(const Tensor& grad, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& mask, const AttentionParams& params, const Tensor& out,
                        const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                        const Tensor& dmask) {
  check_lse(lse, "attention_backward");
  WEAVE_DISPATCH("attention_backward",
                 attention_backward(grad, q, k, v, mask, params, out, lse, dq, dk, dv, dmask));
}

void rotary(const Tensor& x, const Tensor& positions, const Tensor& frequencies, bool interleaved,
            bool inverse, const Tensor& out) {
  WEAVE_DISPATCH(inverse ? "rotary_backward" : "rotary",
                 rotary(x, positions, frequencies, interleaved, inverse, out));
}

#undef WEAVE_DISPATCH

bool attention_takes_reduced(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                             const AttentionParams& params) {
  return on_cuda(q) && cuda::attention_on_tensor_cores(q, k, v, mask, params);
}

bool attention_rows_aligned(const Tensor& t) {
  return on_cuda(t) && cuda::attention_rows_aligned(t);
}

void copy(const Tensor& src, const Tensor& dst) {
  const trace::Scope trace_scope("op", "copy");
  if (src.device() == dst.device()) {
    if (on_cuda(dst)) return cuda::copy(src, dst);
    return cpu::copy(src, dst);
  }
  // Across devices: convert and compact on the source device, move the bytes, then scatter
  // into dst's layout on its device.
  Tensor packed = src;
  if (src.dtype() != dst.dtype() || !src.is_contiguous() || src.shape() != dst.shape()) {
    packed = empty(dst.shape(), {.dtype = dst.dtype(), .device = src.device()});
    copy(src, packed);
  }
  Tensor landing = dst.is_contiguous()
                       ? dst
                       : empty(dst.shape(), {.dtype = dst.dtype(), .device = dst.device()});
  weave::cuda::copy_bytes(landing.data_ptr(), dst.device(), packed.data_ptr(), src.device(),
                          packed.numel() * packed.itemsize());
  if (!landing.is_same(dst)) copy(landing, dst);
}

}  // namespace weave::kernels

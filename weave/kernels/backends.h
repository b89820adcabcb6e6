#pragma once
// The same kernel set, once per backend: cpu/ always, cuda/ (or its no_cuda.cpp stub).
#include "weave/kernels/kernels.h"

#define WEAVE_BACKEND_KERNELS                                                                      \
  void unary(UnaryOp op, const Tensor& x, const Tensor& out);                                      \
  void unary_backward(UnaryOp op, const Tensor& grad, const Tensor& x, const Tensor& y,            \
                      const Tensor& out);                                                          \
  void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out);                   \
  void where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out);             \
  /* same device */                                                                                \
  void copy(const Tensor& src, const Tensor& dst);                                                 \
  void fill(const Tensor& dst, double value);                                                      \
  void reduce(ReduceOp op, const Tensor& x, int64_t outer, int64_t reduced, int64_t inner,         \
              const Tensor& out);                                                                  \
  void matmul(const Tensor& a, const Tensor& b, const Tensor& out, bool accumulate);               \
  void index_select(const Tensor& src, int64_t outer, int64_t n, int64_t inner,                    \
                    const Tensor& index, const Tensor& out);                                       \
  void index_add(const Tensor& dst, int64_t outer, int64_t n, int64_t inner, const Tensor& index,  \
                 const Tensor& src);                                                               \
  void gather_weighted_sum(const Tensor& rows, const Tensor& index, const Tensor& weight,          \
                           const Tensor& out);                                                     \
  void gather_weighted_sum_backward(const Tensor& grad, const Tensor& rows, const Tensor& index,   \
                                    const Tensor& weight, const Tensor& d_rows,                    \
                                    const Tensor& d_weight);                                       \
  void adam_update(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,                 \
                   const Tensor& exp_avg_sq, const AdamStep& step);                                \
  void sgd_update(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer,          \
                  const SgdStep& step);                                                            \
  void adam_update_many(const std::vector<AdamTensors>& tensors, const AdamStep& step);            \
  void norm_power_sum(const std::vector<Tensor>& xs, double p, const Tensor& out);                 \
  void scale_many(const std::vector<Tensor>& xs, double scale);                                    \
  void binned_add(const Tensor& x, const Tensor& window, const Tensor& limbs);                     \
  void binned_raise(const Tensor& window, const Tensor& limbs, const Tensor& to);                  \
  void binned_value(const Tensor& window, const Tensor& limbs, double divisor, const Tensor& out); \
  void exact_power_sum(const std::vector<Tensor>& xs, double p, const Tensor& limbs);              \
  void clip_many(const std::vector<Tensor>& xs, const Tensor& power_sum, double p,                 \
                 double max_norm, const Tensor& norm);                                             \
  void adam_advance(const Tensor& scalars, double beta1, double beta2);                            \
  void attention_softmax(const Tensor& s, const AttentionParams& params, const Tensor& lse);       \
  void attention_probs(const Tensor& s, const AttentionParams& params, const Tensor& lse,          \
                       const Tensor& capped);                                                      \
  void attention_score_grad(const Tensor& dp, const Tensor& p, const Tensor& delta, double scale,  \
                            const Tensor& capped, double softcap);                                 \
  void addcmul(const Tensor& self, const Tensor& a, const Tensor& b, double value, bool divide,    \
               const Tensor& out);                                                                 \
  void lerp(const Tensor& self, const Tensor& end, double weight, const Tensor& out);              \
  void softmax(const Tensor& x, const Tensor& out, bool log);                                      \
  void softmax_backward(const Tensor& grad, const Tensor& y, const Tensor& out, bool log);         \
  void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, bool rms, \
                  const Tensor& out, const Tensor& mean, const Tensor& rstd);                      \
  void layer_norm_backward(const Tensor& grad, const Tensor& x, const Tensor& weight,              \
                           const Tensor& mean, const Tensor& rstd, bool rms, const Tensor& dx,     \
                           const Tensor& dweight, const Tensor& dbias);                            \
  void cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index,             \
                     const Tensor& loss, const Tensor& lse);                                       \
  void cross_entropy_backward(const Tensor& grad, const Tensor& logits, const Tensor& target,      \
                              int64_t ignore_index, const Tensor& lse, const Tensor& dlogits);     \
  void bias_activation(UnaryOp op, const Tensor& x, const Tensor& bias, const Tensor& out);        \
  void bias_activation_backward(UnaryOp op, const Tensor& grad, const Tensor& x,                   \
                                const Tensor& bias, const Tensor& out);                            \
  void gated_activation(UnaryOp op, const Tensor& gate, const Tensor& up, const Tensor& out);      \
  void gated_activation_backward(UnaryOp op, const Tensor& grad, const Tensor& gate,               \
                                 const Tensor& up, const Tensor& dgate, const Tensor& dup);        \
  void attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,            \
                 const AttentionParams& params, const Tensor& out, const Tensor& lse);             \
  void attention_backward(const Tensor& grad, const Tensor& q, const Tensor& k, const Tensor& v,   \
                          const Tensor& mask, const AttentionParams& params, const Tensor& out,    \
                          const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv, \
                          const Tensor& dmask);                                                    \
  void rotary(const Tensor& x, const Tensor& positions, const Tensor& frequencies,                 \
              bool interleaved, bool inverse, const Tensor& out);

namespace weave::kernels::cpu {
WEAVE_BACKEND_KERNELS
}
namespace weave::kernels::cuda {
WEAVE_BACKEND_KERNELS
/// True where attention on q's device runs on tensor cores in q's own dtype: bfloat16 or
/// float16 on sm_80 and newer, head size 64 or 128, no mask, no dropout, no window, soft-cap or
/// query_start; k and v may have fewer
/// heads than q (grouped-query attention), and packed sequences' document ids are taken.
bool attention_on_tensor_cores(const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& mask, const AttentionParams& params);
/// True where t's rows suit the tensor-core kernels (16-byte aligned, strides multiples of 8).
bool attention_rows_aligned(const Tensor& t);
/// The tensor-core attention (attention_on_tensor_cores holds); lse is float32.
void flash_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                     const AttentionParams& params, const Tensor& out, const Tensor& lse);
void flash_attention_backward(const Tensor& grad, const Tensor& q, const Tensor& k, const Tensor& v,
                              const AttentionParams& params, const Tensor& out, const Tensor& lse,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv);
/// The tensor-core attention through cuDNN's fused flash attention (cudnn_attention.cpp; false
/// from no_cudnn.cpp): true where it ran, false where weave's kernels should. It runs where
/// cuDNN plans the shape and is the faster of the two on it (timed on the shape's first call);
/// WEAVE_ATTENTION_KERNEL=cudnn or weave forces one, and WEAVE_CUDNN_DEBUG=1 prints why cuDNN
/// declines a shape and what the timing found.
bool cudnn_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                     const AttentionParams& params, const Tensor& out, const Tensor& lse);
bool cudnn_attention_backward(const Tensor& grad, const Tensor& q, const Tensor& k, const Tensor& v,
                              const AttentionParams& params, const Tensor& out, const Tensor& lse,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv);
}  // namespace weave::kernels::cuda

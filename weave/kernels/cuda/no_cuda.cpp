// Kernel stand-ins used when weave is built without CUDA: every entry point raises weave::Error.
#include "weave/kernels/backends.h"

namespace weave {

namespace {
[[noreturn]] void no_cuda_kernel(const char* what) {
  WEAVE_FAIL(what, "weave was built without CUDA; hint: configure with -DWEAVE_WITH_CUDA=ON");
}
}  // namespace

namespace kernels::cuda {
void unary(UnaryOp, const Tensor&, const Tensor&) {
  no_cuda_kernel("unary");
}
void unary_backward(UnaryOp, const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  no_cuda_kernel("unary");
}
void binary(BinaryOp, const Tensor&, const Tensor&, const Tensor&) {
  no_cuda_kernel("binary");
}
void where(const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  no_cuda_kernel("where");
}
void copy(const Tensor&, const Tensor&) {
  no_cuda_kernel("copy");
}
void fill(const Tensor&, double) {
  no_cuda_kernel("fill");
}
void reduce(ReduceOp, const Tensor&, int64_t, int64_t, int64_t, const Tensor&) {
  no_cuda_kernel("reduce");
}
void matmul(const Tensor&, const Tensor&, const Tensor&, bool) {
  no_cuda_kernel("matmul");
}
void index_select(const Tensor&, int64_t, int64_t, int64_t, const Tensor&, const Tensor&) {
  no_cuda_kernel("index_select");
}
void index_add(const Tensor&, int64_t, int64_t, int64_t, const Tensor&, const Tensor&) {
  no_cuda_kernel("index_add");
}
void gather_weighted_sum(const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  no_cuda_kernel("gather_weighted_sum");
}
void gather_weighted_sum_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, const Tensor&) {
  no_cuda_kernel("gather_weighted_sum_backward");
}
void addcmul(const Tensor&, const Tensor&, const Tensor&, double, bool, const Tensor&) {
  no_cuda_kernel("addcmul");
}
void lerp(const Tensor&, const Tensor&, double, const Tensor&) {
  no_cuda_kernel("lerp");
}
void sgd_update(const Tensor&, const Tensor&, const Tensor&, const SgdStep&) {
  no_cuda_kernel("sgd_update");
}
void adam_update(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const AdamStep&) {
  no_cuda_kernel("adam_update");
}
void adam_update_many(const std::vector<AdamTensors>&, const AdamStep&) {
  no_cuda_kernel("adam_update");
}
void norm_power_sum(const std::vector<Tensor>&, double, const Tensor&) {
  no_cuda_kernel("norm_power_sum");
}
void rotary(const Tensor&, const Tensor&, const Tensor&, bool, bool, const Tensor&) {
  no_cuda_kernel("rotary");
}
void scale_many(const std::vector<Tensor>&, double) {
  no_cuda_kernel("scale_many");
}
void binned_add(const Tensor&, const Tensor&, const Tensor&) {
  no_cuda_kernel("binned_add");
}
void binned_raise(const Tensor&, const Tensor&, const Tensor&) {
  no_cuda_kernel("binned_raise");
}
void binned_value(const Tensor&, const Tensor&, double, const Tensor&) {
  no_cuda_kernel("binned_value");
}
void exact_power_sum(const std::vector<Tensor>&, double, const Tensor&) {
  no_cuda_kernel("exact_power_sum");
}
void clip_many(const std::vector<Tensor>&, const Tensor&, double, double, const Tensor&) {
  no_cuda_kernel("clip_many");
}
void adam_advance(const Tensor&, double, double) {
  no_cuda_kernel("adam_advance");
}
void attention_softmax(const Tensor&, const AttentionParams&, const Tensor&) {
  no_cuda_kernel("attention_softmax");
}
void attention_probs(const Tensor&, const AttentionParams&, const Tensor&, const Tensor&) {
  no_cuda_kernel("attention_probs");
}
void attention_score_grad(const Tensor&, const Tensor&, const Tensor&, double, const Tensor&,
                          double) {
  no_cuda_kernel("attention_score_grad");
}
void softmax(const Tensor&, const Tensor&, bool) {
  no_cuda_kernel("softmax");
}
void softmax_backward(const Tensor&, const Tensor&, const Tensor&, bool) {
  no_cuda_kernel("softmax");
}
void layer_norm(const Tensor&, const Tensor&, const Tensor&, double, bool, const Tensor&,
                const Tensor&, const Tensor&) {
  no_cuda_kernel("layer_norm");
}
void layer_norm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                         bool, const Tensor&, const Tensor&, const Tensor&) {
  no_cuda_kernel("layer_norm");
}
void cross_entropy(const Tensor&, const Tensor&, int64_t, const Tensor&, const Tensor&) {
  no_cuda_kernel("cross_entropy");
}
void cross_entropy_backward(const Tensor&, const Tensor&, const Tensor&, int64_t, const Tensor&,
                            const Tensor&) {
  no_cuda_kernel("cross_entropy");
}
void bias_activation(UnaryOp, const Tensor&, const Tensor&, const Tensor&) {
  no_cuda_kernel("bias_activation");
}
void bias_activation_backward(UnaryOp, const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  no_cuda_kernel("bias_activation");
}
void gated_activation(UnaryOp, const Tensor&, const Tensor&, const Tensor&) {
  no_cuda_kernel("gated_activation");
}
void gated_activation_backward(UnaryOp, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                               const Tensor&) {
  no_cuda_kernel("gated_activation");
}
void attention(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const AttentionParams&,
               const Tensor&, const Tensor&) {
  no_cuda_kernel("scaled_dot_product_attention");
}
void attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        const AttentionParams&, const Tensor&, const Tensor&, const Tensor&,
                        const Tensor&, const Tensor&, const Tensor&) {
  no_cuda_kernel("scaled_dot_product_attention");
}
bool attention_on_tensor_cores(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                               const AttentionParams&) {
  return false;
}
bool attention_rows_aligned(const Tensor&) {
  return false;
}
void flash_attention(const Tensor&, const Tensor&, const Tensor&, const AttentionParams&,
                     const Tensor&, const Tensor&) {
  no_cuda_kernel("scaled_dot_product_attention");
}
void flash_attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const AttentionParams&, const Tensor&, const Tensor&, const Tensor&,
                              const Tensor&, const Tensor&) {
  no_cuda_kernel("scaled_dot_product_attention");
}
}  // namespace kernels::cuda

}  // namespace weave

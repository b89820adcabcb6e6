// Kernel stand-ins used when weave is built without CUDA: every entry point raises weave::Error.
#include "weave/kernels/backends.h"

namespace weave {

namespace {
[[noreturn]] void no_cuda(const char* what) {
  WEAVE_FAIL(what, "weave was built without CUDA; hint: configure with -DWEAVE_WITH_CUDA=ON");
}
}  // namespace

namespace kernels::cuda {
void unary(UnaryOp, const Tensor&, const Tensor&) {
  no_cuda("unary");
}
void unary_backward(UnaryOp, const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  no_cuda("unary");
}
void binary(BinaryOp, const Tensor&, const Tensor&, const Tensor&) {
  no_cuda("binary");
}
void where(const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  no_cuda("where");
}
void copy(const Tensor&, const Tensor&) {
  no_cuda("copy");
}
void fill(const Tensor&, double) {
  no_cuda("fill");
}
void reduce(ReduceOp, const Tensor&, int64_t, int64_t, int64_t, const Tensor&) {
  no_cuda("reduce");
}
void matmul(const Tensor&, const Tensor&, const Tensor&, bool) {
  no_cuda("matmul");
}
void index_select(const Tensor&, int64_t, int64_t, int64_t, const Tensor&, const Tensor&) {
  no_cuda("index_select");
}
void index_add(const Tensor&, int64_t, int64_t, int64_t, const Tensor&, const Tensor&) {
  no_cuda("index_add");
}
void addcmul(const Tensor&, const Tensor&, const Tensor&, double, bool, const Tensor&) {
  no_cuda("addcmul");
}
void lerp(const Tensor&, const Tensor&, double, const Tensor&) {
  no_cuda("lerp");
}
void sgd_update(const Tensor&, const Tensor&, const Tensor&, const SgdStep&) {
  no_cuda("sgd_update");
}
void adam_update(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const AdamStep&) {
  no_cuda("adam_update");
}
void adam_update_many(const std::vector<AdamTensors>&, const AdamStep&) {
  no_cuda("adam_update");
}
void norm_power_sum(const std::vector<Tensor>&, double, const Tensor&) {
  no_cuda("norm_power_sum");
}
void rotary(const Tensor&, const Tensor&, const Tensor&, bool, bool, const Tensor&) {
  no_cuda("rotary");
}
void scale_many(const std::vector<Tensor>&, double) {
  no_cuda("scale_many");
}
void clip_many(const std::vector<Tensor>&, const Tensor&, double, double, const Tensor&) {
  no_cuda("clip_many");
}
void adam_advance(const Tensor&, double, double) {
  no_cuda("adam_advance");
}
void attention_softmax(const Tensor&, double, bool, const Tensor&) {
  no_cuda("attention_softmax");
}
void attention_probs(const Tensor&, double, bool, const Tensor&) {
  no_cuda("attention_probs");
}
void attention_score_grad(const Tensor&, const Tensor&, const Tensor&, double) {
  no_cuda("attention_score_grad");
}
void softmax(const Tensor&, const Tensor&, bool) {
  no_cuda("softmax");
}
void softmax_backward(const Tensor&, const Tensor&, const Tensor&, bool) {
  no_cuda("softmax");
}
void layer_norm(const Tensor&, const Tensor&, const Tensor&, double, bool, const Tensor&,
                const Tensor&, const Tensor&) {
  no_cuda("layer_norm");
}
void layer_norm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                         bool, const Tensor&, const Tensor&, const Tensor&) {
  no_cuda("layer_norm");
}
void cross_entropy(const Tensor&, const Tensor&, int64_t, const Tensor&, const Tensor&) {
  no_cuda("cross_entropy");
}
void cross_entropy_backward(const Tensor&, const Tensor&, const Tensor&, int64_t, const Tensor&,
                            const Tensor&) {
  no_cuda("cross_entropy");
}
void bias_activation(UnaryOp, const Tensor&, const Tensor&, const Tensor&) {
  no_cuda("bias_activation");
}
void bias_activation_backward(UnaryOp, const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  no_cuda("bias_activation");
}
void gated_activation(UnaryOp, const Tensor&, const Tensor&, const Tensor&) {
  no_cuda("gated_activation");
}
void gated_activation_backward(UnaryOp, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                               const Tensor&) {
  no_cuda("gated_activation");
}
void attention(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const AttentionParams&,
               const Tensor&, const Tensor&) {
  no_cuda("scaled_dot_product_attention");
}
void attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        const AttentionParams&, const Tensor&, const Tensor&, const Tensor&,
                        const Tensor&, const Tensor&, const Tensor&) {
  no_cuda("scaled_dot_product_attention");
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
  no_cuda("scaled_dot_product_attention");
}
void flash_attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const AttentionParams&, const Tensor&, const Tensor&, const Tensor&,
                              const Tensor&, const Tensor&) {
  no_cuda("scaled_dot_product_attention");
}
}  // namespace kernels::cuda

}  // namespace weave

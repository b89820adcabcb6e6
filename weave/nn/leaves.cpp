// The whole leaves: nn::Linear, scaled_dot_product_attention, every expert here.
#include "weave/nn/leaves.h"

#include "weave/nn/moe.h"
#include "weave/nn/transformer.h"

namespace weave::nn {

std::shared_ptr<LinearLeaf> Linears::column(int64_t in, int64_t out, bool bias,
                                            Generator* generator) const {
  return std::make_shared<Linear>(in, out, bias, generator);
}

std::shared_ptr<LinearLeaf> Linears::row(int64_t in, int64_t out, bool bias,
                                         Generator* generator) const {
  return std::make_shared<Linear>(in, out, bias, generator);
}

StackedProjection Linears::stacked(int64_t in, int64_t width, bool bias,
                                   Generator* generator) const {
  return stacked_projection(in, width, bias, generator);
}

namespace {
Tensor as_held(const Tensor& factor) {
  return factor;
}
}  // namespace

Tensor Linears::apply_stacked(const Tensor& x, const Tensor& weight, const Tensor& bias,
                              const StackedAdapters& adapters) const {
  return add_stacked_updates(nn::apply_stacked(x, weight, bias), x, adapters, as_held, as_held);
}

LowRankFactors Linears::column_adapter(int64_t in, int64_t out, int64_t rank, Generator& generator,
                                       DType dtype) const {
  return low_rank_factors(in, out, rank, generator, dtype);
}

std::pair<StackedProjection, Linears::KeyValueHeads> Linears::key_values(
    int64_t dim, int64_t heads, int64_t kv_heads, int64_t head_dim, bool bias,
    Generator* generator) const {
  (void)heads;
  return {stacked_projection(dim, kv_heads * head_dim, bias, generator), {kv_heads, 0}};
}

Tensor Linears::project_key_values(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                   const KeyValueHeads& heads, int64_t head_dim,
                                   const StackedAdapters& adapters) const {
  (void)heads;
  (void)head_dim;
  return apply_stacked(x, weight, bias, adapters);
}

std::shared_ptr<Module> Linears::layer_norm(const Shape& shape, double eps) const {
  return std::make_shared<LayerNorm>(shape, eps);
}

Tensor CoreAttention::attend(const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionOptions& options) const {
  return scaled_dot_product_attention(q, k, v, options);
}

Tensor CoreAttention::positions(int64_t start, int64_t length, Device device) const {
  return position_ids(start, length, device);
}

void CoreAttention::check(const char* layer, bool decoding, bool dropout) const {
  (void)layer;
  (void)decoding;
  (void)dropout;
}

std::shared_ptr<MoE> ExpertLeaves::make(const MoEOptions& options) const {
  return std::make_shared<MoE>(options);
}

namespace {

template <typename Kind>
const Kind& or_whole(const std::shared_ptr<const Kind>& set) {
  static const Kind whole;
  return set ? *set : whole;
}

}  // namespace

const Linears& Leaves::linear() const {
  return or_whole(linears);
}
const CoreAttention& Leaves::core() const {
  return or_whole(attention);
}
const ExpertLeaves& Leaves::expert() const {
  return or_whole(experts);
}

}  // namespace weave::nn

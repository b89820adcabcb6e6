// Grouped-query attention with rotary positions.
#include "weave/nn/grouped_query_attention.h"

#include "weave/autograd/grad_mode.h"

namespace weave::nn {

namespace {

constexpr const char* kAttention = "GroupedQueryAttention";

}  // namespace

GroupedQueryAttention::GroupedQueryAttention(int64_t dim, GroupedQueryAttentionOptions options)
    : kv(register_parameter("kv", Tensor())),
      kv_bias(register_parameter("kv_bias", Tensor())),
      dim_(dim),
      head_dim_(0),
      kv_heads_(options.kv_heads == 0 ? options.heads : options.kv_heads),
      options_(options) {
  WEAVE_CHECK(options.heads > 0 && dim > 0 && dim % options.heads == 0, kAttention,
              "dim {} must be a positive multiple of heads {}", dim, options.heads);
  WEAVE_CHECK(kv_heads_ > 0 && options.heads % kv_heads_ == 0, kAttention,
              "kv_heads {} must divide heads {} (each key/value head serves a whole group of "
              "query heads)",
              kv_heads_, options.heads);
  head_dim_ = dim / options.heads;
  q = register_module("q", std::make_shared<Linear>(dim, dim, options.bias, options.generator));
  StackedProjection projection =
      stacked_projection(dim, kv_heads_ * head_dim_, options.bias, options.generator);
  kv = projection.weight;
  kv_bias = projection.bias;
  out = register_module("out",
                        std::make_shared<Linear>(dim, dim, options.out_bias, options.generator));
}

Tensor GroupedQueryAttention::forward(const Tensor& x) {
  return forward_inputs(Inputs(x));
}

Tensor GroupedQueryAttention::forward_inputs(const Inputs& inputs) {
  return attend(inputs, nullptr);
}

Tensor GroupedQueryAttention::forward(const Inputs& inputs, KVCache& cache) {
  return attend(inputs, &cache);
}

Tensor GroupedQueryAttention::attend(const Inputs& inputs, KVCache* cache) {
  const Tensor& x = inputs.x;
  WEAVE_CHECK(x.defined() && x.dim() == 3 && x.size(2) == dim_, kAttention,
              "expected input [B, T, {}], found {}", dim_, x.defined() ? x.shape() : Shape{});
  const int64_t batch = x.size(0), length = x.size(1);
  Tensor queries = (*q)(x).reshape({batch, length, options_.heads, head_dim_});
  Tensor projected =
      apply_stacked(x, kv, kv_bias).reshape({batch, length, 2, kv_heads_, head_dim_});
  Tensor keys = projected.select(2, 0), values = projected.select(2, 1);
  if (options_.rotary) {
    const int64_t start = cache ? cache->length() : 0;
    const Tensor positions =
        inputs.positions.defined() ? inputs.positions : position_ids(start, length, x.device());
    queries = rotary_embedding(queries, positions, *options_.rotary);
    keys = rotary_embedding(keys, positions, *options_.rotary);
  }
  Tensor k = keys.transpose(1, 2), v = values.transpose(1, 2);
  if (cache) {
    WEAVE_CHECK(!inputs.document_ids.defined(), kAttention,
                "decoding with a key/value cache takes one document a row; hint: pass no "
                "document_ids");
    std::tie(k, v) = cache->append(k, v);
  }
  Tensor y = scaled_dot_product_attention(queries.transpose(1, 2), k, v,
                                          {.causal = options_.causal,
                                           .dropout_p = is_training() ? options_.dropout : 0.0,
                                           .generator = options_.generator,
                                           .document_ids = inputs.document_ids});
  return (*out)(y.transpose(1, 2).reshape({batch, length, dim_}));  // heads-last: a view
}

}  // namespace weave::nn

// Tensor- and context-parallel grouped-query attention.
#include "weave/autograd/grad_mode.h"
#include "weave/distributed/functional.h"
#include "weave/parallel/model_parallel/parallel_transformer.h"

namespace weave::parallel {

namespace {

constexpr const char* kAttention = "ParallelGroupedQueryAttention";

}  // namespace

ParallelGroupedQueryAttention::ParallelGroupedQueryAttention(
    int64_t dim, dist::Group group, nn::GroupedQueryAttentionOptions options,
    std::optional<ContextSplit> context)
    : ShardedModule(kAttention, std::move(group)),
      kv(register_parameter("kv", Tensor())),
      kv_bias(register_parameter("kv_bias", Tensor())),
      dim_(dim),
      options_(options),
      context_(std::move(context)) {
  WEAVE_CHECK(options.dropout == 0, kAttention,
              "attention dropout is not split over a tensor-parallel group, found dropout {}; "
              "hint: nn::GroupedQueryAttention takes it",
              options.dropout);
  const int n = this->group().size(), rank = this->group().rank();
  const int64_t heads = options.heads, kv_heads = options.kv_heads == 0 ? heads : options.kv_heads;
  WEAVE_CHECK(heads > 0 && dim > 0 && dim % heads == 0 && kv_heads > 0 && heads % kv_heads == 0,
              kAttention,
              "dim {} must be a positive multiple of heads {}, and kv_heads {} divide it", dim,
              heads, kv_heads);
  WEAVE_CHECK(heads % n == 0 && (kv_heads % n == 0 || n % kv_heads == 0), kAttention,
              "{} query heads and {} key/value heads over the {} ranks of group {}: the query "
              "heads must divide among the ranks, and the key/value heads divide among them or "
              "the ranks among the key/value heads; hint: a tensor-parallel size that divides "
              "both, or a multiple of kv_heads",
              heads, kv_heads, n, this->group().str());
  head_dim_ = dim / heads;
  local_heads_ = heads / n;
  replicated_kv_ = kv_heads % n != 0;
  local_kv_heads_ = replicated_kv_ ? 1 : kv_heads / n;
  // the key/value head this rank's first query head reads
  first_kv_head_ = rank * local_heads_ / (heads / kv_heads);
  // nn::GroupedQueryAttention's initialization, in its order, then split.
  q = register_module(
      "q", std::make_shared<ColumnParallelLinear>(
               dim, dim, this->group(),
               ColumnParallelOptions{.bias = options.bias, .generator = options.generator}));
  const nn::StackedProjection whole =
      nn::stacked_projection(dim, kv_heads * head_dim_, options.bias, options.generator);
  if (replicated_kv_) {
    kv = whole.weight;
    kv_bias = whole.bias;
  } else {
    kv = split_parameter(whole.weight, 1, this->group()).requires_grad_(true);
    if (whole.bias.defined())
      kv_bias = split_parameter(whole.bias, 1, this->group()).requires_grad_(true);
  }
  out = register_module(
      "out", std::make_shared<RowParallelLinear>(
                 dim, dim, this->group(),
                 RowParallelOptions{.bias = options.out_bias, .generator = options.generator}));
}

Tensor ParallelGroupedQueryAttention::forward(const Tensor& x) {
  return forward_inputs(nn::Inputs(x));
}

Tensor ParallelGroupedQueryAttention::forward_inputs(const nn::Inputs& inputs) {
  return run(inputs, nullptr);
}

Tensor ParallelGroupedQueryAttention::forward(const nn::Inputs& inputs, nn::KVCache& cache) {
  WEAVE_CHECK(!context_ && !inputs.document_ids.defined(), kAttention,
              "decoding with a key/value cache takes whole sequences of one document a row: no "
              "context group, no document_ids");
  return run(inputs, &cache);
}

Tensor ParallelGroupedQueryAttention::run(const nn::Inputs& inputs, nn::KVCache* cache) {
  const Tensor& x = inputs.x;
  WEAVE_CHECK(x.defined() && x.dim() == 3 && x.size(2) == dim_, kAttention,
              "expected input [B, T, {}] (batch first), found {}", dim_,
              x.defined() ? x.shape() : Shape{});
  const int64_t batch = x.size(0), length = x.size(1);
  Tensor queries = (*q)(x).reshape({batch, length, local_heads_, head_dim_});
  // The key/value projection's input gradient is summed over the group, as q's is inside it;
  // a replicated kv is summed too (each rank's queries read only their own head of it).
  Tensor weight = replicated_kv_ ? dist::functional::copy_to_group(kv, group()) : kv;
  Tensor bias = kv_bias.defined() && replicated_kv_
                    ? dist::functional::copy_to_group(kv_bias, group())
                    : kv_bias;
  if (replicated_kv_) {
    const int64_t rows = local_kv_heads_ * head_dim_, first = first_kv_head_ * head_dim_;
    weight = weight.narrow(1, first, rows);
    if (bias.defined()) bias = bias.narrow(1, first, rows);
  }
  Tensor projected = nn::apply_stacked(dist::functional::copy_to_group(x, group()), weight, bias)
                         .reshape({batch, length, 2, local_kv_heads_, head_dim_});
  Tensor keys = projected.select(2, 0), values = projected.select(2, 1);
  if (options_.rotary) {
    Tensor positions = inputs.positions;
    if (!positions.defined() && cache) {  // after the cached positions
      positions = position_ids(cache->length(), length, x.device());
    } else if (!positions.defined()) {  // this rank's part of 0 .. T - 1
      const int64_t parts = context_ ? context_->group.size() : 1;
      positions = position_ids(0, length * parts, x.device());
      if (context_) positions = shard_sequence(positions, 0, context_->group, context_->layout);
    }
    queries = rotary_embedding(queries, positions, *options_.rotary);
    keys = rotary_embedding(keys, positions, *options_.rotary);
  }
  Tensor k = keys.transpose(1, 2), v = values.transpose(1, 2);
  if (cache) std::tie(k, v) = cache->append(k, v);
  Tensor y = attend(queries.transpose(1, 2), k, v, inputs.document_ids);
  return (*out)(y.transpose(1, 2).reshape({batch, length, local_heads_ * head_dim_}));
}

Tensor ParallelGroupedQueryAttention::attend(const Tensor& queries, const Tensor& keys,
                                             const Tensor& values, const Tensor& documents) {
  if (!context_)
    return scaled_dot_product_attention(queries, keys, values,
                                        {.causal = options_.causal, .document_ids = documents});
  return context_attention(queries, keys, values, *context_,
                           {.causal = options_.causal, .document_ids = documents});
}

}  // namespace weave::parallel

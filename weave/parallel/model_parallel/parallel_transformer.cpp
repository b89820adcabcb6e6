#include "weave/parallel/model_parallel/parallel_transformer.h"

#include "weave/distributed/functional.h"
#include "weave/parallel/core/placement.h"

namespace weave::parallel {

ParallelAttention::ParallelAttention(int64_t dim, int64_t heads, dist::Group group,
                                     ParallelAttentionOptions options)
    : nn::Module("ParallelAttention"), dim_(dim), options_(options), group_(std::move(group)) {
  WEAVE_CHECK(heads > 0 && dim > 0 && dim % heads == 0, "ParallelAttention",
              "dim {} must be a positive multiple of heads {}", dim, heads);
  WEAVE_CHECK(heads % group_.size() == 0, "ParallelAttention",
              "{} heads do not divide among the {} ranks of group {}; hint: use a tensor-parallel "
              "size that divides the number of heads",
              heads, group_.size(), group_.str());
  local_heads_ = heads / group_.size();
  qkv = register_module("qkv",
                        std::make_shared<ColumnParallelLinear>(
                            dim, 3 * dim, group_,
                            ColumnParallelOptions{.bias = options.bias,
                                                  .sequence_parallel = options.sequence_parallel,
                                                  .generator = options.generator}));
  out =
      register_module("out", std::make_shared<RowParallelLinear>(
                                 dim, dim, group_,
                                 RowParallelOptions{.bias = options.bias,
                                                    .sequence_parallel = options.sequence_parallel,
                                                    .generator = options.generator}));
}

Tensor ParallelAttention::forward(const Tensor& x) {
  return attend(x, nullptr);
}

Tensor ParallelAttention::forward(const Tensor& x, nn::KVCache& cache) {
  WEAVE_CHECK(!options_.sequence_parallel, "ParallelAttention",
              "decoding with a KV cache needs the whole sequence on every rank, found "
              "sequence_parallel; hint: build the decoding model without sequence parallelism "
              "(the parameters are the same)");
  return attend(x, &cache);
}

Tensor ParallelAttention::attend(const Tensor& x, nn::KVCache* cache) {
  WEAVE_CHECK(x.dim() == 3 && x.size(2) == dim_, "ParallelAttention",
              "expected input [T, B, {}] (sequence first), found {}", dim_, x.shape());
  const double p = is_training() ? options_.dropout : 0.0;
  if (options_.context) {
    WEAVE_CHECK(p == 0 && cache == nullptr, "ParallelAttention",
                "context parallelism runs without attention dropout and without a KV cache; "
                "hint: decode with a model built without a context split (the same parameters)");
    Tensor y = nn::fused_qkv_attention((*qkv)(x).transpose(0, 1), local_heads_,
                                       [&](const Tensor& q, const Tensor& k, const Tensor& v) {
                                         return context_attention(q, k, v, *options_.context,
                                                                  {.causal = options_.causal});
                                       });
    return (*out)(y.transpose(0, 1));
  }
  // [T, B, 3 dim / n] seen as [B, T, ...] (a view), attention on the local heads.
  Tensor y = nn::fused_qkv_attention(
      (*qkv)(x).transpose(0, 1), local_heads_,
      {.causal = options_.causal, .dropout_p = p, .generator = options_.generator}, cache);
  return (*out)(y.transpose(0, 1));
}

ParallelMLP::ParallelMLP(int64_t dim, int64_t hidden, dist::Group group, ParallelMLPOptions options)
    : nn::Module("ParallelMLP"), tanh_gelu_(options.tanh_gelu) {
  fc1 = register_module("fc1",
                        std::make_shared<ColumnParallelLinear>(
                            dim, hidden, group,
                            ColumnParallelOptions{.bias = options.bias,
                                                  .sequence_parallel = options.sequence_parallel,
                                                  .skip_bias_add = true,
                                                  .generator = options.generator}));
  fc2 =
      register_module("fc2", std::make_shared<RowParallelLinear>(
                                 hidden, dim, group,
                                 RowParallelOptions{.bias = options.bias,
                                                    .sequence_parallel = options.sequence_parallel,
                                                    .generator = options.generator}));
}

Tensor ParallelMLP::forward(const Tensor& x) {
  return (*fc2)(bias_gelu((*fc1)(x), fc1->bias, tanh_gelu_));
}

ParallelGatedMLP::ParallelGatedMLP(int64_t dim, int64_t hidden, dist::Group group,
                                   ParallelGatedMLPOptions options)
    : ShardedModule("ParallelGatedMLP", std::move(group)),
      gate_up(register_parameter("gate_up", Tensor())),
      gate_up_bias(register_parameter("gate_up_bias", Tensor())),
      options_(options) {
  piece_of(hidden, this->group(), "ParallelGatedMLP", "hidden");
  // nn::GatedMLP's initialization, in its order, then split along hidden.
  const nn::StackedProjection whole =
      nn::stacked_projection(dim, hidden, options.bias, options.generator);
  gate_up = split_parameter(whole.weight, 1, this->group()).requires_grad_(true);
  gate_up_bias = split_parameter(whole.bias, 1, this->group());
  if (gate_up_bias.defined()) gate_up_bias.requires_grad_(true);
  down =
      register_module("down", std::make_shared<RowParallelLinear>(
                                  hidden, dim, this->group(),
                                  RowParallelOptions{.bias = options.bias,
                                                     .sequence_parallel = options.sequence_parallel,
                                                     .generator = options.generator}));
}

Tensor ParallelGatedMLP::forward(const Tensor& x) {
  const dist::Group& g = group();
  Tensor input = options_.sequence_parallel ? dist::functional::gather_from_sequence_group(x, 0, g)
                                            : dist::functional::copy_to_group(x, g);
  Tensor h = nn::apply_stacked(input, gate_up, gate_up_bias);
  return (*down)(nn::gated_activation(h, options_.activation));
}

ParallelTransformerBlock::ParallelTransformerBlock(int64_t dim, int64_t heads, dist::Group group,
                                                   ParallelTransformerBlockOptions options)
    : nn::Module("ParallelTransformerBlock") {
  auto norm = [&]() -> std::shared_ptr<nn::Module> {
    if (options.sequence_parallel)
      return std::make_shared<SequenceParallelLayerNorm>(Shape{dim}, group);
    return std::make_shared<nn::LayerNorm>(Shape{dim});
  };
  norm1 = register_module("norm1", norm());
  attention = register_module(
      "attention", std::make_shared<ParallelAttention>(
                       dim, heads, group,
                       ParallelAttentionOptions{.bias = options.bias,
                                                .causal = options.causal,
                                                .dropout = options.dropout,
                                                .sequence_parallel = options.sequence_parallel,
                                                .generator = options.generator,
                                                .context = options.context}));
  norm2 = register_module("norm2", norm());
  if (options.moe)
    add_experts(dim, options);
  else
    mlp = register_module("mlp",
                          std::make_shared<ParallelMLP>(
                              dim, options.hidden > 0 ? options.hidden : 4 * dim, group,
                              ParallelMLPOptions{.bias = options.bias,
                                                 .tanh_gelu = options.tanh_gelu,
                                                 .sequence_parallel = options.sequence_parallel,
                                                 .generator = options.generator}));
  dropout_ =
      register_module("dropout", std::make_shared<nn::Dropout>(options.dropout, options.generator));
  if (options.context) record_context_reads(*this, options.context->group);
}

void ParallelTransformerBlock::add_experts(int64_t dim,
                                           const ParallelTransformerBlockOptions& options) {
  WEAVE_CHECK(!options.sequence_parallel && options.moe->hidden == dim, "ParallelTransformerBlock",
              "experts need the whole sequence on every tensor-parallel rank and moe.hidden == "
              "dim {}, found sequence_parallel {} and moe.hidden {}; hint: build the block "
              "without sequence parallelism",
              dim, options.sequence_parallel, options.moe->hidden);
  BlockExperts experts =
      make_block_experts(*options.moe, options.expert_group, options.balance_group);
  aux_loss_ = std::move(experts.aux_loss);
  moe = register_module("moe", std::move(experts.module));
}

Tensor ParallelTransformerBlock::aux_loss() const {
  return aux_loss_ ? aux_loss_() : Tensor();
}

Tensor ParallelTransformerBlock::forward(const Tensor& x) {
  return run(x, nullptr);
}

Tensor ParallelTransformerBlock::forward(const Tensor& x, nn::KVCache& cache) {
  return run(x, &cache);
}

Tensor ParallelTransformerBlock::run(const Tensor& x, nn::KVCache* cache) {
  Tensor normed = (*norm1)(x);
  Tensor h = x + (*dropout_)(cache ? attention->forward(normed, *cache) : (*attention)(normed));
  return h + (*dropout_)(mlp ? (*mlp)((*norm2)(h)) : (*moe)((*norm2)(h)));
}

}  // namespace weave::parallel

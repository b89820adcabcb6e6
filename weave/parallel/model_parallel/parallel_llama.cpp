// Tensor- and context-parallel grouped-query attention, and the Llama block built from it.
#include "weave/parallel/model_parallel/parallel_llama.h"

#include "weave/autograd/grad_mode.h"
#include "weave/distributed/functional.h"
#include "weave/ops/side_loss.h"
#include "weave/parallel/core/placement.h"

namespace weave::parallel {

namespace {

constexpr const char* kAttention = "ParallelGroupedQueryAttention";

}  // namespace

ParallelGroupedQueryAttention::ParallelGroupedQueryAttention(
    int64_t dim, dist::Group group, ParallelGroupedQueryAttentionOptions options)
    : ShardedModule(kAttention, std::move(group)),
      kv(register_parameter("kv", Tensor())),
      kv_bias(register_parameter("kv_bias", Tensor())),
      dim_(dim),
      options_(options) {
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
  WEAVE_CHECK(!options_.context_group && !inputs.document_ids.defined(), kAttention,
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
      const int64_t parts = options_.context_group ? options_.context_group->size() : 1;
      positions = position_ids(0, length * parts, x.device());
      if (options_.context_group)
        positions = shard_sequence(positions, 0, *options_.context_group, options_.context_layout);
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
  if (!options_.context_group)
    return scaled_dot_product_attention(queries, keys, values,
                                        {.causal = options_.causal, .document_ids = documents});
  const ContextParallelOptions cp{
      .causal = options_.causal, .layout = options_.context_layout, .document_ids = documents};
  return options_.context_mode == ContextParallelMode::Ring
             ? ring_attention(queries, keys, values, *options_.context_group, cp)
             : all_to_all_attention(queries, keys, values, *options_.context_group, cp);
}

ParallelLlamaBlock::ParallelLlamaBlock(int64_t dim, dist::Group group,
                                       ParallelLlamaBlockOptions options)
    : nn::Module("ParallelLlamaBlock") {
  // nn::LlamaBlock's order: the norms draw nothing, the attention and the MLP their weights.
  norm1 = register_module("norm1", std::make_shared<nn::RMSNorm>(Shape{dim}, options.norm_eps));
  attention = register_module("attention", std::make_shared<ParallelGroupedQueryAttention>(
                                               dim, group,
                                               ParallelGroupedQueryAttentionOptions{
                                                   .heads = options.heads,
                                                   .kv_heads = options.kv_heads,
                                                   .bias = options.qkv_bias,
                                                   .causal = options.causal,
                                                   .rotary = options.rotary,
                                                   .generator = options.generator,
                                                   .context_group = options.context_group,
                                                   .context_mode = options.context_mode,
                                                   .context_layout = options.context_layout}));
  norm2 = register_module("norm2", std::make_shared<nn::RMSNorm>(Shape{dim}, options.norm_eps));
  if (options.moe) {
    WEAVE_CHECK(options.moe->hidden == dim, "ParallelLlamaBlock",
                "the experts' moe.hidden must be the block's dim {}, found {}", dim,
                options.moe->hidden);
    BlockExperts experts =
        make_block_experts(*options.moe, options.expert_group, options.balance_group);
    aux_loss_ = std::move(experts.aux_loss);
    moe = register_module("moe", std::move(experts.module));
  } else {
    const int64_t hidden = options.hidden == 0 ? nn::llama_hidden(dim) : options.hidden;
    mlp = register_module("mlp", std::make_shared<ParallelGatedMLP>(
                                     dim, hidden, group,
                                     ParallelGatedMLPOptions{.activation = options.activation,
                                                             .generator = options.generator}));
  }
  if (options.context_group) record_context_reads(*this, *options.context_group);
}

Tensor ParallelLlamaBlock::forward(const Tensor& x) {
  return forward_inputs(nn::Inputs(x));
}

Tensor ParallelLlamaBlock::forward_inputs(const nn::Inputs& inputs) {
  Tensor h = inputs.x + (*attention)(inputs.with((*norm1)(inputs.x)));
  return h + (moe ? (*moe)((*norm2)(h)) : (*mlp)((*norm2)(h)));
}

Tensor ParallelLlamaBlock::forward(const nn::Inputs& inputs, nn::KVCache& cache) {
  Tensor h = inputs.x + attention->forward(inputs.with((*norm1)(inputs.x)), cache);
  return h + (moe ? (*moe)((*norm2)(h)) : (*mlp)((*norm2)(h)));
}

Tensor ParallelLlamaBlock::aux_loss() const {
  return aux_loss_ ? aux_loss_() : Tensor();
}

ParallelLlamaModel::ParallelLlamaModel(nn::LlamaModelOptions options, dist::Group group,
                                       ParallelLMOptions split)
    : nn::CausalLM("ParallelLlamaModel"),
      group_(std::move(group)),
      vocab_(options.vocab),
      split_(std::move(split)) {
  recompute_blocks_ = options.recompute_blocks;
  WEAVE_CHECK(!options.tie_embeddings, "ParallelLlamaModel",
              "a head tied to the embedding is not split here (the embedding splits by "
              "vocabulary rows, the head by output columns alike, but they would need one "
              "parameter); hint: untie it, or run nn::LlamaModel");
  WEAVE_CHECK(split_.stages >= 1 && split_.stage >= 0 && split_.stage < split_.stages &&
                  options.layers >= split_.stages,
              "ParallelLlamaModel",
              "expected stage s of S stages, 0 <= s < S <= layers ({}), found stage {} of {}",
              options.layers, split_.stage, split_.stages);
  const int64_t padded = padded_vocab(options.vocab, group_.size());
  const int64_t first = options.layers * split_.stage / split_.stages;
  const int64_t last = options.layers * (split_.stage + 1) / split_.stages;
  if (split_.stage == 0)
    embedding = register_module(
        "embedding", std::make_shared<VocabParallelEmbedding>(options.vocab, options.dim, group_,
                                                              options.generator, padded));
  blocks = register_module("blocks", std::make_shared<nn::Sequential>(size_t(first)));
  ParallelLlamaBlockOptions block{.heads = options.block.heads,
                                  .kv_heads = options.block.kv_heads,
                                  .hidden = options.block.hidden,
                                  .rotary = options.block.rotary,
                                  .activation = options.block.activation,
                                  .norm_eps = options.block.norm_eps,
                                  .causal = options.block.causal,
                                  .generator = options.generator,
                                  .context_group = split_.context_group,
                                  .context_mode = split_.context_mode,
                                  .context_layout = split_.context_layout,
                                  .qkv_bias = options.block.qkv_bias,
                                  .expert_group = split_.expert_group,
                                  .balance_group = split_.balance_group};
  for (int64_t i = first; i < last; ++i) {
    block.moe = block_experts(split_, i);
    blocks->push_back(std::make_shared<ParallelLlamaBlock>(options.dim, group_, block));
  }
  if (split_.stage == split_.stages - 1) {
    norm = register_module(
        "norm", std::make_shared<nn::RMSNorm>(Shape{options.dim}, options.block.norm_eps));
    head = register_module(
        "head", std::make_shared<ColumnParallelLinear>(
                    options.dim, padded, group_,
                    ColumnParallelOptions{.bias = false, .generator = options.generator}));
    record_padding(head->weight, group_, vocab_);  // zeroes the padding rows, as the embedding's
  }
  if (split_.context_group) record_context_reads(*this, *split_.context_group);
}

Tensor ParallelLlamaModel::forward(const Tensor& tokens) {
  return forward_inputs(nn::Inputs(tokens));
}

Tensor ParallelLlamaModel::forward_inputs(const nn::Inputs& inputs) {
  const nn::Inputs embedded = inputs.with(embedding ? (*embedding)(inputs.x) : inputs.x);
  const Tensor h = recompute_blocks_ ? blocks->forward_checkpointed(embedded) : (*blocks)(embedded);
  if (!head) {  // a pipeline stage before the last
    // Its experts' balancing losses join the objective through the activation (the last
    // stage's loss can add only its own blocks').
    const Tensor aux = is_training() ? aux_loss() : Tensor();
    return aux.defined() ? attach_loss(h, aux) : h;
  }
  return vocab_parallel_logits((*head)((*norm)(h)), vocab_, group_, split_.gather_logits);
}

std::vector<std::string> ParallelLlamaModel::shard_units() const {
  std::vector<std::string> names;
  if (embedding) names.push_back("embedding");
  for (const auto& [name, block] : blocks->named_children()) names.push_back("blocks." + name);
  if (norm) names.insert(names.end(), {"norm", "head"});
  return names;
}

Tensor ParallelLlamaModel::aux_loss() const {
  Tensor total;
  for (size_t i = 0; i < blocks->size(); ++i)
    if (Tensor aux = static_cast<const ParallelLlamaBlock&>((*blocks)[i]).aux_loss(); aux.defined())
      total = total.defined() ? total + aux : aux;
  return total;
}

std::vector<nn::KVCache> ParallelLlamaModel::make_caches(int64_t max_length) const {
  return std::vector<nn::KVCache>(blocks->size(), nn::KVCache(max_length));
}

Tensor ParallelLlamaModel::forward_cached(const Tensor& tokens, std::vector<nn::KVCache>& caches) {
  WEAVE_CHECK(split_.stages == 1, "ParallelLlamaModel",
              "decoding with caches is not split into pipeline stages; hint: decode with the "
              "whole model (gather it, or load a checkpoint of it)");
  WEAVE_CHECK(!split_.context_group, "ParallelLlamaModel",
              "decoding with caches is not split over a context group; hint: decode with a model "
              "built without one (gather_state_dict)");
  WEAVE_CHECK(caches.size() == blocks->size(), "ParallelLlamaModel",
              "expected a cache per block ({}), found {}; hint: make_caches", blocks->size(),
              caches.size());
  NoGradGuard no_grad;
  Tensor h = (*embedding)(tokens);
  for (size_t i = 0; i < blocks->size(); ++i)
    h = (*blocks)[i].call(nn::Inputs(h), [&](const nn::Inputs& in) {
      return static_cast<ParallelLlamaBlock&>((*blocks)[i]).forward(in, caches[i]);
    });
  return vocab_parallel_logits((*head)((*norm)(h)), vocab_, group_, /*gather=*/true);
}

}  // namespace weave::parallel

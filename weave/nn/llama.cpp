// Grouped-query attention with rotary positions, and the Llama block.
#include "weave/nn/llama.h"

#include "weave/autograd/grad_mode.h"

namespace weave::nn {

namespace {

constexpr const char* kAttention = "GroupedQueryAttention";

}  // namespace

int64_t llama_hidden(int64_t dim) {
  const int64_t hidden = (8 * dim + 2) / 3;
  return (hidden + 63) / 64 * 64;
}

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

LlamaBlock::LlamaBlock(int64_t dim, LlamaBlockOptions options) : Module("LlamaBlock") {
  norm1 = register_module("norm1", std::make_shared<RMSNorm>(Shape{dim}, options.norm_eps));
  attention = register_module(
      "attention", std::make_shared<GroupedQueryAttention>(
                       dim, GroupedQueryAttentionOptions{.heads = options.heads,
                                                         .kv_heads = options.kv_heads,
                                                         .bias = options.qkv_bias,
                                                         .causal = options.causal,
                                                         .rotary = options.rotary,
                                                         .generator = options.generator}));
  norm2 = register_module("norm2", std::make_shared<RMSNorm>(Shape{dim}, options.norm_eps));
  const int64_t hidden = options.hidden == 0 ? llama_hidden(dim) : options.hidden;
  mlp = register_module(
      "mlp", std::make_shared<GatedMLP>(dim, hidden,
                                        GatedMLPOptions{.activation = options.activation,
                                                        .generator = options.generator}));
}

Tensor LlamaBlock::forward(const Tensor& x) {
  return forward_inputs(Inputs(x));
}

Tensor LlamaBlock::forward_inputs(const Inputs& inputs) {
  Tensor h = inputs.x + (*attention)(inputs.with((*norm1)(inputs.x)));
  return h + (*mlp)((*norm2)(h));
}

Tensor LlamaBlock::forward(const Inputs& inputs, KVCache& cache) {
  Tensor h = inputs.x + attention->forward(inputs.with((*norm1)(inputs.x)), cache);
  return h + (*mlp)((*norm2)(h));
}

LlamaModel::LlamaModel(LlamaModelOptions options) : CausalLM("LlamaModel") {
  recompute_blocks_ = options.recompute_blocks;
  WEAVE_CHECK(options.vocab > 0 && options.dim > 0 && options.layers > 0, "LlamaModel",
              "vocab, dim and layers must be positive, found {}, {} and {}", options.vocab,
              options.dim, options.layers);
  embedding = register_module(
      "embedding", std::make_shared<Embedding>(options.vocab, options.dim, options.generator));
  blocks = register_module("blocks", std::make_shared<Sequential>());
  LlamaBlockOptions block = options.block;
  block.generator = options.generator;
  for (int64_t i = 0; i < options.layers; ++i)
    blocks->push_back(std::make_shared<LlamaBlock>(options.dim, block));
  norm = register_module("norm", std::make_shared<RMSNorm>(Shape{options.dim}, block.norm_eps));
  if (!options.tie_embeddings)
    head = register_module(
        "head", std::make_shared<Linear>(options.dim, options.vocab, false, options.generator));
}

Tensor LlamaModel::forward(const Tensor& tokens) {
  return forward_inputs(Inputs(tokens));
}

Tensor LlamaModel::forward_inputs(const Inputs& inputs) {
  const Inputs embedded = inputs.with((*embedding)(inputs.x));
  Tensor h =
      (*norm)(recompute_blocks_ ? blocks->forward_checkpointed(embedded) : (*blocks)(embedded));
  return head ? (*head)(h) : linear(h, embedding->weight);
}

}  // namespace weave::nn

namespace weave::nn {

std::vector<std::string> LlamaModel::shard_units() const {
  std::vector<std::string> names;
  if (head) names.push_back("embedding");  // a tied head reads it after the blocks: the root's
  for (const auto& [name, block] : blocks->named_children()) names.push_back("blocks." + name);
  names.push_back("norm");
  if (head) names.push_back("head");
  return names;
}

std::vector<KVCache> LlamaModel::make_caches(int64_t max_length) const {
  return std::vector<KVCache>(blocks->size(), KVCache(max_length));
}

Tensor LlamaModel::forward_cached(const Tensor& tokens, std::vector<KVCache>& caches) {
  WEAVE_CHECK(caches.size() == blocks->size(), "LlamaModel",
              "expected a cache per block ({}), found {}; hint: make_caches", blocks->size(),
              caches.size());
  NoGradGuard no_grad;
  Tensor h = (*embedding)(tokens);
  for (size_t i = 0; i < blocks->size(); ++i) {
    auto* block = dynamic_cast<LlamaBlock*>(&(*blocks)[i]);
    WEAVE_CHECK(block != nullptr, "LlamaModel",
                "block {} is not an nn::LlamaBlock, which caching "
                "needs",
                i);
    // Between the block's hooks: a fully sharded wrapper gathers it for the step.
    h = block->call(Inputs(h), [&](const Inputs& in) { return block->forward(in, caches[i]); });
  }
  h = (*norm)(h);
  return head ? (*head)(h) : linear(h, embedding->weight);
}

}  // namespace weave::nn

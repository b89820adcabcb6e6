// The Llama block and model: whole layers or their tensor-parallel counterparts, as the split
// says.
#include "weave/models/llama/llama.h"

#include <cmath>

#include "weave/autograd/grad_mode.h"
#include "weave/parallel/core/placement.h"
#include "weave/parallel/model_parallel/context_parallel.h"
#include "weave/parallel/model_parallel/tensor_parallel.h"

namespace weave::models {

namespace {

constexpr const char* kLlama = "Llama";

}  // namespace

LlamaBlockOptions block_options(const LlamaOptions& options, int64_t index) {
  LlamaBlockOptions block = options.block;
  block.generator = options.generator;
  if (options.windowed_layers.empty()) return block;
  if (!options.windowed_layers[size_t(index)]) {
    block.window = 0;
  } else if (options.windowed_rotary) {
    block.rotary = options.windowed_rotary;
  }
  return block;
}

int64_t llama_hidden(int64_t dim) {
  const int64_t hidden = (8 * dim + 2) / 3;
  return (hidden + 63) / 64 * 64;
}

LlamaBlock::LlamaBlock(int64_t dim, LlamaBlockOptions options, const ModelSplit& split,
                       int64_t index)
    : nn::CachedModule("LlamaBlock") {
  const nn::Leaves leaves = split.leaves();
  auto rms_norm = [&] {
    return std::make_shared<nn::RMSNorm>(Shape{dim}, options.norm_eps, true,
                                         options.norm_unit_offset);
  };
  // The norms draw nothing, the attention and the MLP their weights, in this order.
  norm1 = register_module("norm1", rms_norm());
  attention = register_module(
      "attention", std::make_shared<nn::GroupedQueryAttention>(
                       dim,
                       nn::GroupedQueryAttentionOptions{.heads = options.heads,
                                                        .head_dim = options.head_dim,
                                                        .kv_heads = options.kv_heads,
                                                        .bias = options.qkv_bias,
                                                        .causal = options.causal,
                                                        .qk_norm = options.qk_norm,
                                                        .scale = options.attention_scale,
                                                        .window = options.window,
                                                        .softcap = options.attention_softcap,
                                                        .rotary = options.rotary,
                                                        .generator = options.generator},
                       leaves));
  if (options.post_norms) post_norm1 = register_module("post_norm1", rms_norm());
  norm2 = register_module("norm2", rms_norm());
  if (options.post_norms) post_norm2 = register_module("post_norm2", rms_norm());
  if (const auto experts = detail::block_experts(options.moe, index)) {
    WEAVE_CHECK(experts->hidden == dim, "LlamaBlock",
                "the experts' moe.hidden must be the block's dim {}, found {}", dim,
                experts->hidden);
    moe = register_module("moe", leaves.expert().make(*experts));
  } else {
    mlp = register_module("mlp", std::make_shared<nn::GatedMLP>(
                                     dim, options.hidden == 0 ? llama_hidden(dim) : options.hidden,
                                     nn::GatedMLPOptions{.activation = options.activation,
                                                         .generator = options.generator},
                                     leaves));
  }
  if (split.context_group) parallel::record_context_reads(*this, *split.context_group);
}

Tensor LlamaBlock::forward(const Tensor& x) {
  return forward_inputs(nn::Inputs(x));
}

Tensor LlamaBlock::forward_inputs(const nn::Inputs& inputs) {
  const Tensor attended = (*attention)(inputs.with((*norm1)(inputs.x)));
  return mix(inputs.x + (post_norm1 ? (*post_norm1)(attended) : attended));
}

Tensor LlamaBlock::forward(const nn::Inputs& inputs, nn::KVCache& cache) {
  const Tensor attended = attention->forward(inputs.with((*norm1)(inputs.x)), cache);
  return mix(inputs.x + (post_norm1 ? (*post_norm1)(attended) : attended));
}

Tensor LlamaBlock::mix(const Tensor& h) {
  const Tensor mixed = moe ? moe->with_aux_loss((*moe)((*norm2)(h))) : (*mlp)((*norm2)(h));
  return h + (post_norm2 ? (*post_norm2)(mixed) : mixed);
}

Tensor LlamaBlock::aux_loss() const {
  return moe ? moe->aux_loss() : Tensor();
}

Llama::Llama(LlamaOptions options, ModelSplit split)
    : nn::CausalLM(kLlama), options_(options), split_(std::move(split)) {
  WEAVE_CHECK(options.vocab > 0 && options.dim > 0 && options.layers > 0, kLlama,
              "vocab, dim and layers must be positive, found {}, {} and {}", options.vocab,
              options.dim, options.layers);
  split_.check(kLlama, options.layers, options.block.moe.has_value());
  WEAVE_CHECK(!split_.sequence_parallel, kLlama,
              "Llama's tensor-parallel layers take whole sequences (batch first); found "
              "sequence_parallel; hint: split it without sequence parallelism");
  const detail::TokenTable table = detail::stage_token_table(
      options.vocab, options.dim, split_, options.tie_embeddings, options.generator);
  if (table.module) {
    embedding = register_module("embedding", table.module);
    embedding_weight_ = table.weight;
  }
  WEAVE_CHECK(
      options.windowed_layers.empty() || int64_t(options.windowed_layers.size()) == options.layers,
      kLlama, "windowed_layers holds {} entries for {} layers; hint: one a layer, or none",
      options.windowed_layers.size(), options.layers);
  WEAVE_CHECK(std::isfinite(options.logit_softcap) && options.logit_softcap >= 0, kLlama,
              "logit_softcap must be finite and >= 0 (0: none), found {}", options.logit_softcap);
  const auto [first, last] = split_.stage_blocks(options.layers);
  blocks = register_module("blocks", std::make_shared<nn::Sequential>(size_t(first)));
  for (int64_t i = first; i < last; ++i)
    blocks->push_back(
        std::make_shared<LlamaBlock>(options.dim, block_options(options, i), split_, i));
  if (split_.last_stage()) {
    norm = register_module(
        "norm", std::make_shared<nn::RMSNorm>(Shape{options.dim}, options.block.norm_eps, true,
                                              options.block.norm_unit_offset));
    add_head();
  }
  if (split_.context_group) parallel::record_context_reads(*this, *split_.context_group);
}

void Llama::add_head() {
  if (options_.tie_embeddings) return;  // the embedding's table (this stage's copy)
  head = register_module(
      "head", detail::output_head(options_.dim, options_.vocab, false, split_, options_.generator));
}

Tensor& Llama::embedding_weight() {
  WEAVE_CHECK(embedding_weight_ != nullptr, kLlama,
              "stage {} of {} holds no embedding (the first stage does, and a tied last one)",
              split_.stage, split_.stages);
  return *embedding_weight_;
}

Tensor Llama::forward(const Tensor& tokens) {
  return forward_inputs(nn::Inputs(tokens));
}

Tensor Llama::forward_inputs(const nn::Inputs& inputs) {
  const bool first = split_.first_stage();  // a tied last stage holds the embedding too
  if (!first) detail::check_stage_input(kLlama, split_, inputs.x, options_.dim);
  if (first && split_.context_group)  // parts cut as the split reads them, or every rank raises
    parallel::check_sequence_part(inputs.x, inputs.positions, inputs.document_ids,
                                  *split_.context(), kLlama);
  const Tensor h = run_blocks(*blocks, inputs.with(first ? embed(inputs.x) : inputs.x));
  if (!norm) return h;
  return logits((*norm)(h), split_.gather_logits);
}

// Gemma multiplies by sqrt(dim) rounded to the activations' dtype, as its reference does.
Tensor Llama::embed(const Tensor& tokens) {
  const Tensor rows = (*embedding)(tokens);
  if (!options_.scale_embedding) return rows;
  const double normalizer =
      full({}, std::sqrt(double(options_.dim)), {.dtype = rows.dtype()}).item<double>();
  return rows * normalizer;
}

Tensor Llama::logits(const Tensor& hidden, bool gather) {
  return detail::head_logits(hidden, head.get(), head ? Tensor() : embedding_weight(),
                             options_.vocab, split_, gather, options_.logit_softcap);
}

std::vector<std::string> Llama::shard_units() const {
  std::vector<std::string> names;
  // A tied head reads the embedding after the blocks: then it is the root's.
  if (embedding && !options_.tie_embeddings) names.push_back("embedding");
  for (const auto& [name, block] : blocks->named_children()) names.push_back("blocks." + name);
  if (norm) names.push_back("norm");
  if (head) names.push_back("head");
  return names;
}

Tensor Llama::aux_loss() const {
  return detail::sum_aux_losses(*blocks);
}

std::vector<nn::KVCache> Llama::make_caches(int64_t max_length) const {
  return std::vector<nn::KVCache>(blocks->size(), nn::KVCache(max_length));
}

Tensor Llama::forward_cached(const Tensor& tokens, std::vector<nn::KVCache>& caches) {
  split_.check_decoding(kLlama, caches.size(), blocks->size());
  NoGradGuard no_grad;
  Tensor h = embed(tokens);
  for (size_t i = 0; i < blocks->size(); ++i) {
    auto& block = static_cast<nn::CachedModule&>((*blocks)[i]);
    // Between the block's hooks: a fully sharded wrapper gathers it for the step.
    h = block.call(nn::Inputs(h),
                   [&](const nn::Inputs& in) { return block.forward(in, caches[i]); });
  }
  return logits((*norm)(h), /*gather=*/true);
}

}  // namespace weave::models

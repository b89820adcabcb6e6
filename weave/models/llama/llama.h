#pragma once
// Llama-class models (Llama, Mistral, Qwen 2): grouped-query attention with rotary positions, a
// gated MLP (or a mixture of experts), RMSNorms; one class whether whole or split over ranks
// (models::ModelSplit: tensor, context, pipeline and expert parallelism). Positions and document
// ids (nn::Inputs) reach every block: windows packed with several documents attend within each.
//
//   models::Llama model({.vocab = 32000, .dim = 512, .layers = 8,
//                        .block = {.heads = 8, .kv_heads = 2, .rotary = RotaryOptions{.base =
//                        500000}}});
//   Tensor logits = model({tokens, positions, document_ids});   // [B, T] -> [B, T, vocab]
//   Tensor text = nn::generate(model, prompt, {.max_new_tokens = 64});
//
//   models::Llama part(options, models::ModelSplit::from_mesh(mesh));  // this rank's slices
//   parallel::load_pretrained(part, config, "llama/");                 // each reads its own
//
// Split over a tensor group, forward gives this rank's vocabulary slice of the logits
// [B, T, padded / n] (for split.cross_entropy) unless split.gather_logits; with split.vocabulary
// (from_mesh's default over the shard group) the slice covers every batch rank's rows,
// [n B, T, padded / pieces] (parallel/model_parallel/tensor_parallel_vocabulary.h). A vocabulary
// that does not divide among the ranks is padded (parallel::padded_vocab), its padding masked out
// of the logits, and the embedding and head parameters are the padded ones. Built from the same
// seed on every rank, each rank holds the slices of the whole model, under its parameter names.
#include <optional>
#include <vector>

#include "weave/data/hf/model_config.h"
#include "weave/models/model_split.h"
#include "weave/nn/generation.h"
#include "weave/nn/grouped_query_attention.h"

namespace weave::models {

/// Llama's MLP width for a model width: 8 dim / 3, rounded up to a multiple of 64.
int64_t llama_hidden(int64_t dim);

struct LlamaBlockOptions {
  int64_t heads = 8;
  /// Key/value heads, dividing heads (1: multi-query attention); 0: as many as heads.
  int64_t kv_heads = 0;
  /// The gated MLP's hidden width; llama_hidden(dim) when 0.
  int64_t hidden = 0;
  std::optional<RotaryOptions> rotary = RotaryOptions{};
  nn::GatedActivation activation = nn::GatedActivation::SiLU;
  double norm_eps = 1e-5;
  bool causal = true;
  Generator* generator = nullptr;
  /// Biases of the q, k and v projections (Qwen 2's).
  bool qkv_bias = false;
  /// Each attention head's size; 0: dim / heads (Qwen 3 and Gemma 3 set it apart).
  int64_t head_dim = 0;
  /// Per-head RMSNorm of queries and keys before rotary (Qwen 3's q_norm and k_norm).
  std::optional<nn::HeadNormOptions> qk_norm = std::nullopt;
  /// Multiplies q k^T; 1 / sqrt(head_dim) when unset.
  std::optional<double> attention_scale = std::nullopt;
  /// Sliding window of the attention (Mistral's sliding_window): each position sees its
  /// `window` latest; 0: all earlier ones. LlamaOptions::windowed_layers picks the blocks.
  int64_t window = 0;
  /// Soft-caps the attention scores (Gemma 2's attn_logit_softcapping); 0: none.
  double attention_softcap = 0.0;
  /// Every RMSNorm of the model scales by (1 + weight), the weights starting at 0 (Gemma's).
  bool norm_unit_offset = false;
  /// RMSNorms after the attention and after the MLP too, before each joins the residual
  /// (Gemma 2 and 3: post_attention_layernorm and post_feedforward_layernorm).
  bool post_norms = false;
  /// A mixture of experts in place of the gated MLP (moe->hidden is dim), block i's seeded
  /// moe->seed + i. While training, each block's balancing loss travels with its output into
  /// backward (nn::MoE::with_aux_loss), on every pipeline stage: the trainer adds nothing.
  std::optional<nn::MoEOptions> moe = std::nullopt;
};

/// A pre-RMSNorm block: h = x + attention(norm1(x)), then h + mlp(norm2(h)); with post_norms
/// h = x + post_norm1(attention(norm1(x))), then h + post_norm2(mlp(norm2(h))). Its attention is
/// nn::GroupedQueryAttention and its MLP nn::GatedMLP, built with the split's leaves (split over
/// split.tensor, attending over split.context_group), or with options.moe a mixture of experts
/// registered as "moe" (block `index`'s seed; spread over split.expert_group).
class LlamaBlock : public nn::CachedModule {
 public:
  LlamaBlock(int64_t dim, LlamaBlockOptions options = {}, const ModelSplit& split = {},
             int64_t index = 0);
  Tensor forward(const Tensor& x) override;
  Tensor forward_inputs(const nn::Inputs& inputs) override;
  /// With a key/value cache for the attention (generation).
  Tensor forward(const nn::Inputs& inputs, nn::KVCache& cache) override;
  /// The last forward's load-balancing and z-loss, for reporting (undefined without experts).
  Tensor aux_loss() const;
  std::shared_ptr<nn::RMSNorm> norm1, norm2;
  /// With post_norms: after the attention and after the MLP (null without).
  std::shared_ptr<nn::RMSNorm> post_norm1, post_norm2;
  std::shared_ptr<nn::GroupedQueryAttention> attention;
  /// The MLP, or (with experts) null and `moe` the mixture of experts.
  std::shared_ptr<nn::GatedMLP> mlp;
  std::shared_ptr<nn::MoE> moe;

 private:
  Tensor mix(const Tensor& h);
};

struct LlamaOptions {
  int64_t vocab = 32000;
  int64_t dim = 512;
  int64_t layers = 8;
  /// Every block's options (their generator is the model's).
  LlamaBlockOptions block{};
  /// The head multiplies by the embedding's weight instead of one of its own (Llama 3.2's and
  /// the small Qwen 2's); split, the last pipeline stage holds a copy tied to the first's.
  bool tie_embeddings = false;
  /// Which blocks attend through block.window (true) and which see every earlier position
  /// (Hugging Face's layer_types: Gemma's local and global layers, Qwen 2's max_window_layers);
  /// empty: every block as `block` says. One entry a layer.
  std::vector<bool> windowed_layers{};
  /// The rotary embedding of the windowed blocks where it differs from block.rotary (Gemma 3's
  /// rope_local_base_freq); unset: block.rotary.
  std::optional<RotaryOptions> windowed_rotary = std::nullopt;
  /// Soft-caps the logits: cap tanh(logits / cap) (Gemma 2's final_logit_softcapping); 0: none.
  double logit_softcap = 0.0;
  /// The embedding's rows times sqrt(dim), rounded to their dtype (Gemma's); the tied head reads
  /// the table as it is.
  bool scale_embedding = false;
  Generator* generator = nullptr;
};

/// Block `index`'s options: options.block with the model's generator and, where
/// windowed_layers says, its window and rotary or none.
LlamaBlockOptions block_options(const LlamaOptions& options, int64_t index);

/// A decoder-only language model: token ids [B, T] -> logits [B, T, vocab] through an embedding,
/// `layers` LlamaBlocks ("blocks.<i>"), a final RMSNorm and the head.
class Llama : public nn::CausalLM {
 public:
  explicit Llama(LlamaOptions options = {}, ModelSplit split = {});
  Tensor forward(const Tensor& tokens) override;
  Tensor forward_inputs(const nn::Inputs& inputs) override;
  int64_t vocab() const override { return options_.vocab; }
  std::vector<nn::KVCache> make_caches(int64_t max_length) const override;
  Tensor forward_cached(const Tensor& tokens, std::vector<nn::KVCache>& caches) override;
  /// FSDP's units: this stage's embedding (unless a tied head reads it after the blocks: then
  /// the root's), each block, the final norm and the head.
  std::vector<std::string> shard_units() const override;
  /// With experts: the last forward's load-balancing and z-losses of this stage's blocks,
  /// summed, for reporting (backward already differentiates them); undefined without experts.
  Tensor aux_loss() const override;
  const LlamaOptions& options() const { return options_; }
  const ModelSplit& split() const { return split_; }
  /// The embedding table (this rank's vocabulary rows when split); the first stage's, and with a
  /// tied head the last stage's copy.
  Tensor& embedding_weight();

  /// nn::Embedding, or parallel::VocabParallelEmbedding; null past the first pipeline stage
  /// (but on a tied last stage).
  std::shared_ptr<nn::Module> embedding;
  std::shared_ptr<nn::Sequential> blocks;  // this stage's
  std::shared_ptr<nn::RMSNorm> norm;       // null before the last stage
  /// nn::Linear, or parallel::VocabParallelHead over the vocabulary; null when tied and
  /// before the last stage.
  std::shared_ptr<nn::Module> head;

 private:
  void add_head();
  Tensor logits(const Tensor& hidden, bool gather);
  Tensor embed(const Tensor& tokens);
  LlamaOptions options_;
  ModelSplit split_;
  Tensor* embedding_weight_ = nullptr;
};

/// The options of a Hugging Face Llama configuration (LlamaForCausalLM, Qwen2ForCausalLM).
LlamaOptions llama_options(const data::hf::ModelConfig& config, Generator* generator = nullptr);
/// The configuration of a model built from its options, to export it: dims, heads, rotary base
/// and scaling, norms' eps, tied head, Qwen 2's biases. Raises for what Hugging Face's Llama
/// cannot describe (interleaved or partial rotary, another gated activation, a non-causal
/// block), naming it.
data::hf::ModelConfig model_config(const LlamaOptions& options, DType dtype = kFloat32);

}  // namespace weave::models

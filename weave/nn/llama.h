#pragma once
// The layers of Llama-class models (Llama, Mistral, Qwen): grouped-query attention with rotary
// positions, and the block that joins it to a gated MLP under RMSNorms. Both read the side
// inputs of nn::Inputs: the tokens' positions and, for windows packed with several documents,
// the document ids (attention stays within a document; positions restart at each).
//
//   nn::LlamaBlock block(512, {.heads = 8, .kv_heads = 2, .hidden = 1408,
//                              .rotary = {.base = 500000}});
//   Tensor y = block({x, positions, document_ids});   // x [B, T, 512]; ids [B, T] or [T]
//   Tensor z = block(x);                               // positions 0 .. T-1, one document
#include <optional>

#include "weave/nn/generation.h"
#include "weave/nn/transformer.h"

namespace weave::nn {

struct GroupedQueryAttentionOptions {
  int64_t heads = 8;
  /// Key/value heads, dividing heads (1: multi-query attention); 0: as many as heads.
  int64_t kv_heads = 0;
  /// Biases of the q and kv projections (Qwen 2's q, k and v have them; Llama's none).
  bool bias = false;
  /// A bias of the out projection.
  bool out_bias = false;
  bool causal = true;
  /// Rotary embeddings of q and k; none when unset.
  std::optional<RotaryOptions> rotary = RotaryOptions{};
  /// Dropout on the attention probabilities, in training mode.
  double dropout = 0.0;
  Generator* generator = nullptr;
};

/// Self-attention with `kv_heads` key/value heads shared by `heads` query heads. The query
/// projection q [heads * head_dim, dim] and the key/value projection kv [2, kv_heads *
/// head_dim, dim] (kv[0] for keys, kv[1] for values: one GEMM) are separate, so a tensor-
/// parallel split cuts each along its heads. Keys and values are never repeated per query head
/// (scaled_dot_product_attention reads the shared heads in place).
class GroupedQueryAttention : public Module {
 public:
  GroupedQueryAttention(int64_t dim, GroupedQueryAttentionOptions options = {});
  /// x [B, T, dim] -> [B, T, dim], at positions 0 .. T-1, one document.
  Tensor forward(const Tensor& x) override;
  /// The same at inputs.positions, attending within inputs.document_ids.
  Tensor forward_inputs(const Inputs& inputs) override;
  /// x after the positions `cache` holds (at positions cache.length() onwards unless
  /// inputs.positions says), attending to them too; appends this call's keys and values.
  Tensor forward(const Inputs& inputs, KVCache& cache);
  int64_t heads() const { return options_.heads; }
  int64_t kv_heads() const { return kv_heads_; }
  std::shared_ptr<Linear> q;    // [heads * head_dim, dim]
  Tensor& kv;                   // [2, kv_heads * head_dim, dim]
  Tensor& kv_bias;              // [2, kv_heads * head_dim], undefined without bias
  std::shared_ptr<Linear> out;  // [dim, heads * head_dim]

 private:
  Tensor attend(const Inputs& inputs, KVCache* cache);
  int64_t dim_, head_dim_, kv_heads_;
  GroupedQueryAttentionOptions options_;
};

/// Llama's MLP width for a model width: 8 dim / 3, rounded up to a multiple of 64.
int64_t llama_hidden(int64_t dim);

struct LlamaBlockOptions {
  int64_t heads = 8;
  int64_t kv_heads = 0;
  /// The gated MLP's hidden width; 8 dim / 3 rounded up to a multiple of 64 (Llama's rule)
  /// when 0.
  int64_t hidden = 0;
  std::optional<RotaryOptions> rotary = RotaryOptions{};
  GatedActivation activation = GatedActivation::SiLU;
  double norm_eps = 1e-5;
  bool causal = true;
  Generator* generator = nullptr;
  /// Biases of the q, k and v projections (Qwen 2's).
  bool qkv_bias = false;
};

/// A pre-RMSNorm block: h = x + attention(norm1(x)), then h + mlp(norm2(h)).
class LlamaBlock : public Module {
 public:
  LlamaBlock(int64_t dim, LlamaBlockOptions options = {});
  Tensor forward(const Tensor& x) override;
  Tensor forward_inputs(const Inputs& inputs) override;
  /// With a key/value cache for the attention (generation).
  Tensor forward(const Inputs& inputs, KVCache& cache);
  std::shared_ptr<RMSNorm> norm1, norm2;
  std::shared_ptr<GroupedQueryAttention> attention;
  std::shared_ptr<GatedMLP> mlp;
};

struct LlamaModelOptions {
  int64_t vocab = 32000;
  int64_t dim = 512;
  int64_t layers = 8;
  /// Every block's options (their generator is the model's).
  LlamaBlockOptions block{};
  /// The head multiplies by the embedding's weight instead of one of its own.
  bool tie_embeddings = false;
  Generator* generator = nullptr;
  /// Activation checkpointing of every block (Megatron's full recomputation, one block at a
  /// time): backward keeps each block's input and side inputs and runs the block again when it
  /// gets there, its collectives included (ParallelLlamaModel honors it too: tensor, context,
  /// pipeline and expert parallelism). The gradients are bitwise the plain run's.
  bool recompute_blocks = false;
};

/// A decoder-only language model: token ids [B, T] -> logits [B, T, vocab] through an
/// embedding, `layers` LlamaBlocks, a final RMSNorm and the head. Positions and document ids
/// (nn::Inputs) reach every block.
class LlamaModel : public CausalLM {
 public:
  explicit LlamaModel(LlamaModelOptions options = {});
  Tensor forward(const Tensor& tokens) override;
  Tensor forward_inputs(const Inputs& inputs) override;
  int64_t vocab() const override { return embedding->weight.size(0); }
  std::vector<KVCache> make_caches(int64_t max_length) const override;
  Tensor forward_cached(const Tensor& tokens, std::vector<KVCache>& caches) override;
  /// Each block, the final norm, the head, and the embedding unless the head reads it (tied).
  std::vector<std::string> shard_units() const override;
  std::shared_ptr<Embedding> embedding;
  std::shared_ptr<Sequential> blocks;
  std::shared_ptr<RMSNorm> norm;
  std::shared_ptr<Linear> head;  // null with tie_embeddings
};

}  // namespace weave::nn

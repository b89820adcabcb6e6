#pragma once
// The Llama-class layers (nn/llama.h) split over a tensor-parallel group, with context
// parallelism in their attention: every axis a Llama trains on, inside the library.
//
//   parallel::ParallelLlamaBlock block(512, tp, {.heads = 8, .kv_heads = 2,
//                                                .context_group = cp});
//   Tensor y = block({x, positions, document_ids});   // x [B, T / cp, 512]: this rank's part
//
// Layout: batch first, [B, T, dim], as nn::LlamaBlock. Without a context group every rank of
// the tensor group passes the whole sequence and gets the whole output; with one, each rank
// passes its part of every sequence (shard_sequence in context_layout) with the positions and
// document ids of that part (both derived from the part's place when positions are left out).
//
// Built from the same seed on every rank, each layer holds the slices of its nn counterpart
// (same parameter names), so shard_state_dict / gather_state_dict convert between them.
#include <functional>
#include <optional>

#include "weave/nn/llama.h"
#include "weave/parallel/model_parallel/context_parallel.h"
#include "weave/parallel/model_parallel/experts.h"
#include "weave/parallel/model_parallel/parallel_transformer.h"
#include "weave/parallel/model_parallel/tensor_parallel.h"

namespace weave::parallel {

struct ParallelGroupedQueryAttentionOptions {
  int64_t heads = 8;
  /// Key/value heads, dividing heads; 0: as many as heads.
  int64_t kv_heads = 0;
  /// Biases of q and kv, and of out (nn::GroupedQueryAttentionOptions).
  bool bias = false;
  bool out_bias = false;
  bool causal = true;
  std::optional<RotaryOptions> rotary = RotaryOptions{};
  Generator* generator = nullptr;
  /// Context parallelism (ring_attention or all_to_all_attention over this group).
  std::optional<dist::Group> context_group = std::nullopt;
  ContextParallelMode context_mode = ContextParallelMode::Ring;
  SequenceLayout context_layout = SequenceLayout::ZigZag;
};

/// nn::GroupedQueryAttention with its heads split: rank r holds query heads [r H / n,
/// (r + 1) H / n) (q column-parallel) and out's matching columns (row-parallel). The key/value
/// heads those queries read are split alike when n divides kv_heads; with fewer key/value heads
/// than ranks, every rank holds the whole kv and projects only the head its queries read, and
/// kv's gradient is summed over the group (Megatron's replicated key/value heads).
class ParallelGroupedQueryAttention : public ShardedModule {
 public:
  ParallelGroupedQueryAttention(int64_t dim, dist::Group group,
                                ParallelGroupedQueryAttentionOptions options = {});
  Tensor forward(const Tensor& x) override;
  Tensor forward_inputs(const nn::Inputs& inputs) override;
  /// Decoding: x after the positions `cache` holds (this rank's key/value heads), attending to
  /// them too. Not with a context group.
  Tensor forward(const nn::Inputs& inputs, nn::KVCache& cache);
  int64_t local_heads() const { return local_heads_; }
  int64_t local_kv_heads() const { return local_kv_heads_; }
  /// Whether every rank holds the whole kv (fewer key/value heads than ranks).
  bool replicates_kv() const { return replicated_kv_; }
  std::shared_ptr<ColumnParallelLinear> q;
  Tensor& kv;       // [2, kv_heads / n * head_dim, dim], or [2, kv_heads * head_dim, dim]
  Tensor& kv_bias;  // undefined without bias
  std::shared_ptr<RowParallelLinear> out;

 private:
  Tensor attend(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& documents);
  Tensor run(const nn::Inputs& inputs, nn::KVCache* cache);
  int64_t dim_, head_dim_, local_heads_, local_kv_heads_, first_kv_head_;
  bool replicated_kv_;
  ParallelGroupedQueryAttentionOptions options_;
};

struct ParallelLlamaBlockOptions {
  int64_t heads = 8;
  int64_t kv_heads = 0;
  /// The gated MLP's hidden width (dividing among the ranks); Llama's rule when 0.
  int64_t hidden = 0;
  std::optional<RotaryOptions> rotary = RotaryOptions{};
  nn::GatedActivation activation = nn::GatedActivation::SiLU;
  double norm_eps = 1e-5;
  bool causal = true;
  Generator* generator = nullptr;
  std::optional<dist::Group> context_group = std::nullopt;
  ContextParallelMode context_mode = ContextParallelMode::Ring;
  SequenceLayout context_layout = SequenceLayout::ZigZag;
  /// Biases of the q, k and v projections (Qwen 2's).
  bool qkv_bias = false;
  /// A mixture of experts in place of the MLP (moe->hidden is dim), registered as "moe": spread
  /// over expert_group when it has several ranks (the ranks of the tensor group hold the same
  /// experts and route the same tokens), its load-balancing loss over balance_group's batches
  /// (make_block_experts).
  std::optional<nn::MoEOptions> moe = std::nullopt;
  std::optional<dist::Group> expert_group = std::nullopt;
  std::optional<dist::Group> balance_group = std::nullopt;
};

/// nn::LlamaBlock split over a tensor-parallel group: the RMSNorms whole on every rank, the
/// attention ParallelGroupedQueryAttention, the MLP ParallelGatedMLP (or a mixture of experts).
class ParallelLlamaBlock : public nn::Module {
 public:
  ParallelLlamaBlock(int64_t dim, dist::Group group, ParallelLlamaBlockOptions options = {});
  Tensor forward(const Tensor& x) override;
  Tensor forward_inputs(const nn::Inputs& inputs) override;
  /// With a key/value cache for the attention (decoding).
  Tensor forward(const nn::Inputs& inputs, nn::KVCache& cache);
  /// The last forward's load-balancing and z-loss (undefined without experts): add it to the
  /// loss.
  Tensor aux_loss() const;
  std::shared_ptr<nn::RMSNorm> norm1, norm2;
  std::shared_ptr<ParallelGroupedQueryAttention> attention;
  /// The MLP, or (with options.moe) null and `moe` the mixture of experts.
  std::shared_ptr<ParallelGatedMLP> mlp;
  std::shared_ptr<nn::Module> moe;

 private:
  std::function<Tensor()> aux_loss_;
};

/// nn::LlamaModel over a tensor-parallel group, with the same parameter names: the embedding
/// split by vocabulary (VocabParallelEmbedding), ParallelLlamaBlocks, the final RMSNorm whole,
/// and the head column-parallel. forward returns this rank's vocabulary slice of the logits
/// [B, T, padded / n] (for vocab_parallel_cross_entropy) unless split.gather_logits, when every
/// rank gets all `vocab` of them; with split.context_group each rank passes its part of every
/// sequence (and may pass that part's positions and document ids as side inputs); with
/// split.stages, it is one pipeline stage of the model. Decoding
/// (forward_cached, nn::generate) gathers them. A vocabulary that does not divide among the ranks
/// is padded (padded_vocab), its padding masked out of the logits; the embedding and head
/// parameters are then the padded ones.
///
///   parallel::ParallelLlamaModel model(options, mesh.tensor());
///   parallel::load_pretrained(model, config, "llama/");   // each rank reads its slices
///   Tensor tokens = nn::generate(model, prompt, {.max_new_tokens = 64});   // on every rank
class ParallelLlamaModel : public nn::CausalLM {
 public:
  ParallelLlamaModel(nn::LlamaModelOptions options, dist::Group group,
                     ParallelLMOptions split = {});
  Tensor forward(const Tensor& tokens) override;
  Tensor forward_inputs(const nn::Inputs& inputs) override;
  int64_t vocab() const override { return vocab_; }
  std::vector<nn::KVCache> make_caches(int64_t max_length) const override;
  Tensor forward_cached(const Tensor& tokens, std::vector<nn::KVCache>& caches) override;
  /// With split.moe: the last forward's load-balancing and z-losses of this stage's blocks,
  /// summed (add it to the loss); undefined without experts.
  Tensor aux_loss() const;
  /// This stage's embedding, blocks, final norm and head, each a unit of its own.
  std::vector<std::string> shard_units() const override;
  std::shared_ptr<VocabParallelEmbedding> embedding;  // null past the first pipeline stage
  std::shared_ptr<nn::Sequential> blocks;             // this stage's ("blocks.<i>")
  std::shared_ptr<nn::RMSNorm> norm;                  // null before the last stage
  std::shared_ptr<ColumnParallelLinear> head;         // null before the last stage

 private:
  dist::Group group_;
  int64_t vocab_;
  ParallelLMOptions split_;
};

}  // namespace weave::parallel

#pragma once
// Tensor-parallel transformer layers (Megatron-LM): attention heads and MLP hidden units split
// over a tensor-parallel group, optionally with sequence parallelism.
//
//   dist::Group tp = mesh.tensor();
//   parallel::ParallelTransformerBlock block(384, 6, tp, {.sequence_parallel = true});
//   Tensor y = block(x);     // x [T / n, B, 384]: this rank's slice of the sequence
//
// Layout: sequence first, [T, B, dim] (Megatron's), so that a rank's slice of the sequence is
// contiguous and sequence parallelism's gathers and scatters move whole blocks. Without
// sequence parallelism every rank passes the whole [T, B, dim] and gets the whole output.
//
// Each layer is its unsharded counterpart split: built with the same seed on every rank it
// holds the slices of nn::MultiheadAttention, nn::MLP or nn::TransformerBlock (same parameter
// names), so shard_state_dict / gather_state_dict convert between them.
#include <functional>
#include <memory>
#include <optional>

#include "weave/nn/grouped_query_attention.h"
#include "weave/nn/moe.h"
#include "weave/nn/transformer.h"
#include "weave/parallel/model_parallel/context_parallel.h"
#include "weave/parallel/model_parallel/experts.h"
#include "weave/parallel/model_parallel/tensor_parallel.h"

namespace weave::parallel {

struct ParallelAttentionOptions {
  bool bias = true;
  bool causal = false;
  /// Dropout on the attention probabilities, in training mode (drawn from `generator` on every
  /// rank: in lockstep when every rank seeds it alike).
  double dropout = 0.0;
  /// Input and output [T / n, B, dim], split along the sequence.
  bool sequence_parallel = false;
  Generator* generator = nullptr;
  /// Context parallelism: the input holds this rank's positions of a sequence split over
  /// context->group, and attention runs over the whole sequence. Not with dropout or a KV cache.
  std::optional<ContextSplit> context = std::nullopt;
};

/// Self-attention with heads / n heads per rank: the fused q/k/v projection is one
/// ColumnParallelLinear [3 dim / n, dim] (rows head-major, so each rank's rows are whole heads),
/// attention runs on the local heads, and the output projection is a RowParallelLinear that
/// sums (or, with sequence parallelism, reduce-scatters) the heads' contributions.
class ParallelAttention : public nn::Module {
 public:
  ParallelAttention(int64_t dim, int64_t heads, dist::Group group,
                    ParallelAttentionOptions options = {});
  /// x [T, B, dim] ([T / n, B, dim] with sequence parallelism) -> the same shape.
  Tensor forward(const Tensor& x) override;
  /// Decoding: attends also to the positions in `cache` (this rank's heads) and appends this
  /// call's. Not with sequence parallelism (one new position cannot be split).
  Tensor forward(const Tensor& x, nn::KVCache& cache);
  int64_t local_heads() const { return local_heads_; }
  std::shared_ptr<ColumnParallelLinear> qkv;
  std::shared_ptr<RowParallelLinear> out;

 private:
  Tensor attend(const Tensor& x, nn::KVCache* cache);
  int64_t dim_, local_heads_;
  ParallelAttentionOptions options_;
  dist::Group group_;
};

struct ParallelMLPOptions {
  bool bias = true;
  bool tanh_gelu = false;
  bool sequence_parallel = false;
  Generator* generator = nullptr;
};

/// nn::MLP with its hidden units split: fc1 column-parallel (its bias fused into the GELU),
/// fc2 row-parallel.
class ParallelMLP : public nn::Module {
 public:
  ParallelMLP(int64_t dim, int64_t hidden, dist::Group group, ParallelMLPOptions options = {});
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<ColumnParallelLinear> fc1;
  std::shared_ptr<RowParallelLinear> fc2;

 private:
  bool tanh_gelu_;
};

struct ParallelGatedMLPOptions {
  nn::GatedActivation activation = nn::GatedActivation::SiLU;
  bool bias = false;
  bool sequence_parallel = false;
  Generator* generator = nullptr;
};

/// nn::GatedMLP with its hidden units split: rank r holds piece r of the gate's rows and of
/// up's (gate_up [2, hidden / n, dim]: column-parallel, still one GEMM), and down is
/// row-parallel. Same parameter names as nn::GatedMLP.
class ParallelGatedMLP : public ShardedModule {
 public:
  ParallelGatedMLP(int64_t dim, int64_t hidden, dist::Group group,
                   ParallelGatedMLPOptions options = {});
  Tensor forward(const Tensor& x) override;
  Tensor& gate_up;       // [2, hidden / n, dim]
  Tensor& gate_up_bias;  // [2, hidden / n]
  std::shared_ptr<RowParallelLinear> down;

 private:
  ParallelGatedMLPOptions options_;
};

/// nn::GroupedQueryAttention with its heads split (batch first, [B, T, dim], and the same
/// parameter names): rank r holds query heads [r H / n, (r + 1) H / n) (q column-parallel) and
/// out's matching columns (row-parallel). The key/value heads those queries read are split alike
/// when n divides kv_heads; with fewer key/value heads than ranks, every rank holds the whole kv
/// and projects only the head its queries read, and kv's gradient is summed over the group
/// (Megatron's replicated key/value heads). With a context split each rank passes its part of
/// every sequence with that part's positions and document ids (the positions derived from the
/// part's place when left out). No attention dropout.
///
///   parallel::ParallelGroupedQueryAttention attention(512, tp, {.heads = 8, .kv_heads = 2},
///                                                     parallel::ContextSplit{cp});
///   Tensor y = attention({x, positions, document_ids});   // x [B, T / cp, 512]
class ParallelGroupedQueryAttention : public ShardedModule {
 public:
  ParallelGroupedQueryAttention(int64_t dim, dist::Group group,
                                nn::GroupedQueryAttentionOptions options = {},
                                std::optional<ContextSplit> context = std::nullopt);
  Tensor forward(const Tensor& x) override;
  Tensor forward_inputs(const nn::Inputs& inputs) override;
  /// Decoding: x after the positions `cache` holds (this rank's key/value heads), attending to
  /// them too. Not with a context split.
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
  nn::GroupedQueryAttentionOptions options_;
  std::optional<ContextSplit> context_;
};

struct ParallelTransformerBlockOptions {
  /// The MLP's hidden width; 4 dim when 0.
  int64_t hidden = 0;
  bool causal = true;
  double dropout = 0.0;
  bool bias = true;
  bool tanh_gelu = false;
  /// LayerNorms, residuals and dropout run on [T / n, B, dim] sequence slices (their
  /// activations 1/n the size); the norms' gradients are summed over the group.
  bool sequence_parallel = false;
  Generator* generator = nullptr;
  /// Context parallelism for the attention (ParallelAttentionOptions::context).
  std::optional<ContextSplit> context = std::nullopt;
  /// A mixture of experts in place of the MLP (moe->hidden is dim), registered as "moe": spread
  /// over expert_group (ExpertParallelMoE, Megatron's expert parallelism) when it has several
  /// ranks, else nn::MoE. The ranks of the tensor group hold the same experts and route the same
  /// tokens. Not with sequence parallelism.
  std::optional<nn::MoEOptions> moe = std::nullopt;
  std::optional<dist::Group> expert_group = std::nullopt;
  /// The ranks whose batches one step trains on together (data x context): the load-balancing
  /// loss counts their assignments, so the block equals one process on the stacked batch.
  std::optional<dist::Group> balance_group = std::nullopt;
};

/// nn::TransformerBlock split over a tensor-parallel group (pre-LayerNorm, attention + MLP).
class ParallelTransformerBlock : public nn::Module {
 public:
  ParallelTransformerBlock(int64_t dim, int64_t heads, dist::Group group,
                           ParallelTransformerBlockOptions options = {});
  Tensor forward(const Tensor& x) override;
  Tensor forward(const Tensor& x, nn::KVCache& cache);
  /// nn::LayerNorm, or SequenceParallelLayerNorm with sequence parallelism.
  std::shared_ptr<nn::Module> norm1, norm2;
  std::shared_ptr<ParallelAttention> attention;
  /// The MLP, or (with options.moe) null and `moe` the mixture of experts.
  std::shared_ptr<ParallelMLP> mlp;
  std::shared_ptr<nn::Module> moe;
  /// The last forward's load-balancing and z-loss (zero without experts): add it to the loss.
  Tensor aux_loss() const;

 private:
  std::function<Tensor()> aux_loss_;
  Tensor run(const Tensor& x, nn::KVCache* cache);
  void add_experts(int64_t dim, const ParallelTransformerBlockOptions& options);
  std::shared_ptr<nn::Dropout> dropout_;
};

}  // namespace weave::parallel

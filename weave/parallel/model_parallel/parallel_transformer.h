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
  /// Context parallelism: the input holds this rank's positions of a sequence split over this
  /// group (in context_layout), and attention runs over the whole sequence
  /// (parallel::ring_attention, or all_to_all_attention). Not with dropout or a KV cache.
  std::optional<dist::Group> context_group = std::nullopt;
  ContextParallelMode context_mode = ContextParallelMode::Ring;
  SequenceLayout context_layout = SequenceLayout::ZigZag;
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

/// How a tensor-parallel causal language model (ParallelGPT2Model, ParallelLlamaModel) runs
/// beyond its tensor group.
struct ParallelLMOptions {
  /// forward gives every rank all the logits; else this rank's vocabulary slice (for
  /// vocab_parallel_cross_entropy). Decoding always gathers them.
  bool gather_logits = false;
  /// Context parallelism: each rank of this group passes its part of every sequence
  /// (shard_sequence(tokens, 1, group, context_layout)) and gets that part's logits, positions
  /// taken from the part's place. Decoding with caches is not split so: it raises.
  std::optional<dist::Group> context_group = std::nullopt;
  ContextParallelMode context_mode = ContextParallelMode::Ring;
  SequenceLayout context_layout = SequenceLayout::ZigZag;
  /// Pipeline parallelism: the model is stage `stage` of `stages` (parallel::Pipeline runs
  /// them): blocks [layers stage / stages, layers (stage + 1) / stages) under their names in the
  /// whole model ("blocks.<i>"), the embedding on the first stage (which takes the tokens), the
  /// final norm and the head on the last (which gives the logits); between, hidden states
  /// [B, T, dim] flow. Decoding with caches raises.
  int stage = 0;
  int stages = 1;
  /// Expert parallelism: every block's MLP a mixture of experts (block i's seeded moe->seed + i),
  /// spread over expert_group when it has several ranks, its load-balancing loss counting the
  /// assignments of balance_group's batches (data x context); the model's aux_loss() sums the
  /// blocks' (add it to the loss).
  std::optional<nn::MoEOptions> moe = std::nullopt;
  std::optional<dist::Group> expert_group = std::nullopt;
  std::optional<dist::Group> balance_group = std::nullopt;
};

/// Block i's mixture of experts under ParallelLMOptions (its own seed), or none.
std::optional<nn::MoEOptions> block_experts(const ParallelLMOptions& split, int64_t block);

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
  /// Context parallelism for the attention (ParallelAttentionOptions::context_group).
  std::optional<dist::Group> context_group = std::nullopt;
  ContextParallelMode context_mode = ContextParallelMode::Ring;
  SequenceLayout context_layout = SequenceLayout::ZigZag;
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

#pragma once
// How a model of weave/models is split over ranks: one value, empty on one process and made from
// a ProcessMesh in one call. The model builds its layers (written once, in nn/) with the leaves
// the split gives (leaves(): tensor-parallel linears, context-parallel attention, experts spread
// over ranks; nn/leaves.h), each layer holding the slices of the whole layer under the same
// parameter names.
//
//   models::Llama whole(options);                                          // one process
//   models::Llama part(options, models::ModelSplit::from_mesh(mesh));      // this rank's part
//
// The architecture (experts included: LlamaBlockOptions::moe, GPT2Options::moe) is the options';
// the split holds only groups and how to use them.
#include <optional>
#include <utility>

#include "weave/nn/leaves.h"
#include "weave/nn/module.h"
#include "weave/nn/moe.h"
#include "weave/parallel/core/mesh.h"
#include "weave/parallel/model_parallel/context_parallel.h"
#include "weave/parallel/model_parallel/tensor_parallel_vocabulary.h"

namespace weave::models {

struct ModelSplit {
  /// Tensor parallelism (Megatron's): attention heads, MLP units and the vocabulary split over
  /// this group. Without it every layer is whole.
  std::optional<dist::Group> tensor = std::nullopt;
  /// The model's forward gives every rank all the logits; else (with a tensor group) this
  /// rank's vocabulary slice, for parallel::vocab_parallel_cross_entropy. Decoding gathers them.
  bool gather_logits = false;
  /// Megatron's sequence parallelism (with a tensor group of several ranks): between the
  /// tensor-parallel matrix products, the norms and residuals hold 1/n of the sequence, and
  /// hidden states between pipeline stages are this rank's part [B, T / n, dim]. Decoding
  /// raises; without context parallelism or experts, which need whole sequences (GPT-2's).
  bool sequence_parallel = false;
  /// Context parallelism: each rank of this group passes its part of every sequence
  /// (local_inputs, or parallel::shard_sequence(tokens, 1, group, layout)) and gets that part's
  /// logits, positions taken from the part's place. Decoding raises.
  std::optional<dist::Group> context_group = std::nullopt;
  parallel::ContextParallelMode context_mode = parallel::ContextParallelMode::Ring;
  parallel::SequenceLayout context_layout = parallel::SequenceLayout::ZigZag;
  /// Pipeline parallelism: the model is stage `stage` of `stages` (parallel::Pipeline runs
  /// them): blocks [layers stage / stages, layers (stage + 1) / stages) under their names in the
  /// whole model ("blocks.<i>"), the embedding on the first stage (which takes the tokens), the
  /// final norm and the head on the last (which gives the logits); between, hidden states
  /// [B, T, dim] flow. Decoding raises.
  int stage = 0;
  int stages = 1;
  /// A model with experts spreads them over expert_group, and its load-balancing losses count
  /// the assignments of balance_group's batches (data x context), so that they equal one
  /// process's on the whole batch. A model without experts ignores both.
  std::optional<dist::Group> expert_group = std::nullopt;
  std::optional<dist::Group> balance_group = std::nullopt;
  /// The vocabulary split over the ranks that read different batches too (FSDP's shard group,
  /// with the tensor group if any: parallel::VocabularyGroups): the embedding and the head hold
  /// 1/n of the vocabulary's rows on each of tensor x shard, the ids and hidden states travel
  /// instead of the tables, and forward gives this rank's vocabulary slice of every batch rank's
  /// rows' logits, [n B, T, piece] (for cross_entropy, which gives this rank's rows' mean),
  /// unless gather_logits (this rank's rows, every column). FSDP never gathers these pieces and
  /// DDP never averages them whole (each rank holds its own). Unset: the vocabulary is split over
  /// the tensor group alone, if any.
  std::optional<parallel::VocabularyGroups> vocabulary = std::nullopt;
  /// from_mesh sets `vocabulary` over mesh.vocabulary() and mesh.shard() when the shard group has
  /// several ranks; false leaves it unset (each rank then holds the whole embedding and head, or
  /// the tensor group's piece, and FSDP gathers them as units).
  bool shard_vocabulary = true;

  /// This rank's split in `mesh`: its tensor group (when the mesh has tensor ranks), its context
  /// group and pipeline stage, its expert group (when the mesh has expert ranks), the data x
  /// context ranks that balance experts, and with base.shard_vocabulary the vocabulary's groups
  /// (when the shard group has several ranks); the rest (context mode and layout, gather_logits,
  /// sequence_parallel) from `base`.
  static ModelSplit from_mesh(const parallel::ProcessMesh& mesh, ModelSplit base);
  static ModelSplit from_mesh(const parallel::ProcessMesh& mesh);

  /// The context split of the attention layers, or none.
  std::optional<parallel::ContextSplit> context() const;
  /// The leaves the model's layers are built with (nn/leaves.h): tensor-parallel linears over
  /// `tensor` (with sequence_parallel), context-parallel attention over `context_group`, experts
  /// spread over `expert_group` and balanced over `balance_group`; whole where unset.
  nn::Leaves leaves() const;
  /// No layer of a model built with this split is cut over ranks (no tensor group, one
  /// pipeline stage, no experts spread, no vocabulary split): its parameters are the whole
  /// model's.
  bool whole() const;
  /// The groups the embedding's and the head's vocabulary is split over: `vocabulary`, else the
  /// tensor group's own, else none (whole).
  std::optional<parallel::VocabularyGroups> vocabulary_groups() const;
  /// The blocks [first, last) this stage holds of a model of `layers`.
  std::pair<int64_t, int64_t> stage_blocks(int64_t layers) const;
  bool first_stage() const { return stage == 0; }
  bool last_stage() const { return stage == stages - 1; }
  /// Raises, naming `model`, for a stage outside [0, stages), more stages than layers, or
  /// sequence parallelism it cannot take (a model `with_experts` needs whole sequences).
  void check(const char* model, int64_t layers, bool with_experts = false) const;
  /// Raises, naming `model`, unless key/value caches can decode with this split (no pipeline
  /// stages, no context group) and there is one cache per block.
  void check_decoding(const char* model, size_t caches, size_t blocks) const;

  /// This rank's part of a batch, for the model's forward: under a context group each rank's
  /// part of every sequence (context_layout) of the tokens, positions and document ids; as they
  /// are otherwise. Collective-free.
  nn::Inputs local_inputs(const nn::Inputs& inputs) const;
  /// This rank's part along T of a [B, T] tensor such as the targets (the positions
  /// local_inputs keeps); undefined stays undefined.
  Tensor local_sequence(const Tensor& targets) const;
  /// Mean cross-entropy of this model's logits [..., vocab] against this rank's targets: over
  /// the vocabulary's pieces when the logits are their slices (parallel::
  /// vocab_parallel_cross_entropy: over batches, this rank's rows' mean), plain cross_entropy
  /// otherwise. Under a context group each rank's mean covers its positions (average over the
  /// group for the batch's).
  Tensor cross_entropy(const Tensor& logits, const Tensor& targets) const;
};

namespace detail {

/// Block `index`'s experts: `experts` seeded experts->seed + index, or none.
std::optional<nn::MoEOptions> block_experts(const std::optional<nn::MoEOptions>& experts,
                                            int64_t index);
/// A token embedding chosen from the split: nn::Embedding, or over split.vocabulary_groups() a
/// parallel::VocabParallelEmbedding of the padded vocabulary (parallel::padded_vocab); `weight`
/// points at its table (this rank's rows).
struct TokenTable {
  std::shared_ptr<nn::Module> module;
  Tensor* weight = nullptr;
};
TokenTable token_table(int64_t vocab, int64_t dim, const ModelSplit& split, Generator* generator);
/// This stage's token table: the first stage's embedding and, when the head is tied to it, the
/// last stage's copy (in a pipeline tied to the first's: parallel::Pipeline adds their
/// gradients after each step, Megatron-LM's shared embedding); none between (module null).
TokenTable stage_token_table(int64_t vocab, int64_t dim, const ModelSplit& split, bool tied_head,
                             Generator* generator);
/// An untied output head chosen from the split: nn::Linear(dim, vocab, bias), or over
/// split.vocabulary_groups() a parallel::VocabParallelHead of the padded vocabulary.
std::shared_ptr<nn::Module> output_head(int64_t dim, int64_t vocab, bool bias,
                                        const ModelSplit& split, Generator* generator);
/// The logits of `head` (output_head's), or with head null of a head tied to `table` (this
/// rank's vocabulary rows when split): hidden [B, T, dim] (this rank's part of T under sequence
/// parallelism) -> [B, T, vocab], when split this rank's vocabulary slice (of every batch rank's
/// rows: [n B, T, piece]) unless `gather` (padding masked out), soft-capped by `softcap` (0: not).
Tensor head_logits(const Tensor& hidden, nn::Module* head, const Tensor& table, int64_t vocab,
                   const ModelSplit& split, bool gather, double softcap = 0.0);
/// cap tanh(logits / cap) (Gemma 2's final_logit_softcapping); logits as they are for cap 0.
Tensor soft_capped(const Tensor& logits, double cap);
/// Raises, naming `model`, unless `hidden` is a previous stage's output [B, T, dim].
void check_stage_input(const char* model, const ModelSplit& split, const Tensor& hidden,
                       int64_t dim);
/// The sum of the last forward's aux_loss() of the mixtures of experts in `module` (undefined
/// when it holds none), for reporting.
Tensor sum_aux_losses(const nn::Module& module);

}  // namespace detail

}  // namespace weave::models

#pragma once
// A vocabulary split over ranks: the rows of an embedding table and of an output head, and the
// cross-entropy over logits split by vocabulary, none of them ever gathered whole (Megatron-LM's
// vocabulary parallelism, and the same over the ranks that read different batches).
//
// Two kinds of ranks split a vocabulary; together they hold its pieces:
//   tensor    ranks that read the same rows (Megatron's tensor group): each looks up its rows of
//             every id and the group sums them; each computes its slice of every row's logits,
//             and the loss is the same on every one of them (tensor_parallel.h's convention)
//   batches   ranks that read different rows (FSDP's shard group: data x context): the ids and
//             the hidden states are all-gathered over them and each rank gets its own rows back,
//             so what moves is activations [rows, dim], never a table [vocab, dim]
// Rank (t, b) holds piece pieces.rank() = t x batches.size() + b of the padded vocabulary
// (padded_vocab(vocab, pieces.size())): ProcessMesh::vocabulary() orders its ranks so.
//
//   parallel::VocabularyGroups groups{.pieces = mesh.vocabulary(), .batches = mesh.shard()};
//   parallel::VocabParallelEmbedding table(vocab, dim, groups, &generator,
//                                          parallel::padded_vocab(vocab, groups.pieces.size()));
//   Tensor h = table(ids);                                       // this rank's rows [B, T, dim]
//   Tensor logits = linear(parallel::vocabulary_rows(h, groups), table.weight);  // [n B, T, piece]
//   logits = parallel::vocab_parallel_logits(logits, vocab, groups, /*gather=*/false);
//   parallel::vocab_parallel_cross_entropy(logits.reshape({-1, piece}), y.reshape({-1}),
//                                          groups).backward();   // this rank's rows' mean
//
// Gradients over `batches` follow the data-parallel convention: each rank's loss is the mean over
// its own rows, and a piece's gradient sums every rank's loss (all of the group's rows pass
// through it), as an expert's gradient sums its expert group's batches. The piece's placement
// says so (a Split cut with across_batches), and the data-parallel wrappers divide it by their
// group's size where they average the rest (placement.h: ReplicaGroups); FSDP keeps each piece
// as this rank's own shard and never gathers it.
#include <optional>

#include "weave/parallel/model_parallel/tensor_parallel.h"

namespace weave::parallel {

/// The ranks a vocabulary is split over, and how they read rows.
struct VocabularyGroups {
  /// Every rank holding a piece: tensor x batches, tensor-major (mesh.vocabulary()).
  dist::Group pieces;
  /// Ranks of `pieces` that read the same rows (a tensor group), or none.
  std::optional<dist::Group> tensor = std::nullopt;
  /// Ranks of `pieces` that read different rows (a data-parallel shard group), or none.
  std::optional<dist::Group> batches = std::nullopt;
  /// Sequence parallelism: the tensor ranks hold different parts of each sequence (axis 1) of
  /// the hidden states; vocabulary_rows gathers them.
  bool sequence_parallel = false;

  /// A tensor group's own vocabulary split (Megatron's).
  static VocabularyGroups over_tensor(const dist::Group& tensor, bool sequence_parallel = false);
  /// Raises, naming `op`, unless pieces is tensor x batches with this rank at piece
  /// tensor.rank() x batches.size() + batches.rank(). Collective-free.
  void check(const char* op) const;
  /// The piece's rows of a vocabulary padded among the pieces.
  int64_t padded(int64_t vocab) const;
};

/// An embedding table [vocab, dim] split by rows: each rank looks up the ids in its range, the
/// ranks reading the same ids sum the rows, and over `batches` each rank looks up its rows for
/// every rank's ids, the partial rows reduce-scattered back to their owners (every id lives on
/// exactly one piece). With padded_rows (> vocab, dividing by the pieces: padded_vocab) the table
/// has that many rows, the rows past vocab zero and never looked up; else vocab must divide.
class VocabParallelEmbedding : public ShardedModule {
 public:
  VocabParallelEmbedding(int64_t vocab, int64_t dim, VocabularyGroups groups,
                         Generator* generator = nullptr, int64_t padded_rows = 0);
  /// Over a tensor group alone (Megatron's).
  VocabParallelEmbedding(int64_t vocab, int64_t dim, dist::Group group,
                         Generator* generator = nullptr, int64_t padded_rows = 0);
  /// ids: integer tensor of any shape, in [0, vocab) -> [..., dim]. Over `batches` every rank
  /// passes ids of one shape (a rank whose shape differs raises on every rank).
  Tensor forward(const Tensor& ids) override;
  const VocabularyGroups& groups() const { return groups_; }
  Tensor& weight;  // [padded_rows (or vocab) / pieces, dim]

 private:
  VocabularyGroups groups_;
  int64_t vocab_;
};

/// An output head [vocab, dim] (and bias [vocab]) split by rows as VocabParallelEmbedding's
/// table: nn::Linear(dim, vocab, bias)'s initialization over padded_rows (0: vocab) rows, cut,
/// the padding zero. Its forward gives this rank's vocabulary slice of the logits of
/// vocabulary_rows(hidden) (every batch rank's rows), padding columns as they are:
/// vocab_parallel_logits masks or gathers them.
class VocabParallelHead : public ShardedModule {
 public:
  VocabParallelHead(int64_t dim, int64_t vocab, VocabularyGroups groups, bool bias = false,
                    Generator* generator = nullptr, int64_t padded_rows = 0);
  /// hidden [B, T, dim] (this rank's rows) -> [n B, T, piece].
  Tensor forward(const Tensor& hidden) override;
  const VocabularyGroups& groups() const { return groups_; }
  Tensor& weight;  // [padded_rows / pieces, dim]
  Tensor& bias;    // [padded_rows / pieces], or undefined

 private:
  VocabularyGroups groups_;
};

/// The hidden states a vocabulary piece's head multiplies: `hidden` [B, T, dim] (this rank's
/// rows) all-gathered over `batches` ([n B, T, dim], rank b's rows at b B), and over `tensor`
/// entered as a tensor-parallel region (its gradient summed; under sequence parallelism
/// gathered along T). Collective over both groups.
Tensor vocabulary_rows(const Tensor& hidden, const VocabularyGroups& groups);

/// Cross-entropy of logits split along the last (vocabulary) axis, without gathering them:
/// the maximum, the sum of exponentials and the target's logit are reduced over the pieces.
/// logits [N, V / n] (rank r holds classes [r V/n, (r+1) V/n)). Over a tensor group alone,
/// targets [N] int64 (the same on every rank) and the result (mean or sum over N) is the same
/// on every rank. Over `batches`, logits are every rank's rows (vocabulary_rows: [n M, V / n]),
/// targets [M] this rank's, and the result is this rank's rows' mean or sum. Exact gradients for
/// the local logits; padding columns at -infinity (vocab_parallel_logits) take no part.
Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets,
                                    const VocabularyGroups& groups, bool mean = true);
Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets,
                                    const dist::Group& group, bool mean = true);

/// The vocabulary a model split over n ranks pads its embedding and head to (Megatron's padded
/// vocabulary): vocab itself when n divides it, else the next multiple of lcm(128, n). GPT-2's
/// 50257 becomes 50304 for every power of two n up to 128, so sharded checkpoints move between
/// those sizes. The padded rows are never looked up, and vocab_parallel_logits masks them out.
int64_t padded_vocab(int64_t vocab, int n);

/// What a vocabulary-parallel head gives: `logits` [..., piece] are this rank's slice of the
/// padded vocabulary's (piece pieces.rank()); the columns past `vocab` become -infinity (no
/// probability in softmax or vocab_parallel_cross_entropy, and no gradient). With gather,
/// every rank gets all `vocab` columns of its own rows instead (over batches an all_to_all that
/// sends each rank its rows' slices, [n B, T, piece] -> [B, T, vocab]; over tensor an
/// all_gather; then the padding dropped).
Tensor vocab_parallel_logits(const Tensor& logits, int64_t vocab, const VocabularyGroups& groups,
                             bool gather);
Tensor vocab_parallel_logits(const Tensor& logits, int64_t vocab, const dist::Group& group,
                             bool gather);

}  // namespace weave::parallel

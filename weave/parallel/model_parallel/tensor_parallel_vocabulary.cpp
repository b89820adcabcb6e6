// A vocabulary split over tensor and batch ranks: the lookup, the rows a head multiplies, the
// logits' padding and gathering, and the cross-entropy, each the whole vocabulary's math with
// dist::functional's mappings where the split changes.
#include "weave/parallel/model_parallel/tensor_parallel_vocabulary.h"

#include <limits>
#include <numeric>

#include "weave/autograd/grad_mode.h"
#include "weave/distributed/functional.h"
#include "weave/ops/ops.h"

namespace weave::parallel {

namespace F = dist::functional;

namespace {

// Every rank of `batches` passes rows of one shape (the all-gathers pair equal buffers): one
// small agreement, so a rank whose batch differs raises with the others instead of hanging.
void check_same_rows(const Tensor& t, const dist::Group& batches, const char* op) {
  const std::vector<int64_t> mine = {int64_t(t.dim()), t.dim() ? t.size(0) : 0,
                                     t.dim() > 1 ? t.size(1) : 0};
  std::vector<int64_t> words;
  for (int64_t w : mine) {
    words.push_back(w);
    words.push_back(-w);
  }
  const std::vector<int64_t> agreed = dist::agree_max(words, batches);
  for (size_t i = 0; i < mine.size(); ++i)
    WEAVE_CHECK(agreed[2 * i] == -agreed[2 * i + 1], op,
                "the ranks of batch group {} pass rows of different shapes (this rank {}): the "
                "vocabulary split over them gathers every rank's rows; hint: give every rank "
                "batches of one shape (drop_last), or build the model without "
                "ModelSplit::shard_vocabulary",
                batches.str(), t.shape());
}

// Every rank's rows of `t`, stacked along axis 0 in the group's order (no gradient: ids,
// targets).
Tensor gather_rows(const Tensor& t, const dist::Group& batches) {
  NoGradGuard no_grad;
  Shape shape = t.shape();
  shape[0] *= batches.size();
  Tensor all = empty(shape, {.dtype = t.dtype(), .device = t.device()});
  dist::all_gather(all, t.contiguous(), batches);
  return all;
}

// Per-row losses of logits [N, piece] against targets [N], over every piece of the vocabulary.
Tensor piece_losses(const Tensor& logits, const Tensor& targets, const dist::Group& pieces) {
  const int64_t piece = logits.size(1), start = pieces.rank() * piece;
  Tensor global_max, other;
  {
    // the shift only keeps exp() finite: any constant per row gives the same loss and
    // gradient, so it is taken out of the graph
    NoGradGuard no_grad;
    global_max = max(logits.detach(), {1}, true).contiguous();
    if (pieces.size() > 1) dist::all_reduce(global_max, dist::ReduceOp::Max, pieces);
    Tensor columns = arange(double(start), double(start + piece), 1.0,
                            {.dtype = kInt64, .device = logits.device()});
    other = ne(unsqueeze(targets.to(kInt64), 1), unsqueeze(columns, 0));
  }
  Tensor shifted = logits - global_max;
  Tensor sum_exp = F::reduce_from_group(sum(exp(shifted), {1}), pieces);
  // masked, not multiplied by a 0/1 mask: padding columns at -infinity would make 0 * -inf
  Tensor target_logit = F::reduce_from_group(sum(masked_fill(shifted, other, 0.0), {1}), pieces);
  return log(sum_exp) - target_logit;
}

// The rows of a whole table split over the pieces: padded_rows (0: vocab), checked.
int64_t table_rows(int64_t vocab, int64_t padded_rows, const VocabularyGroups& groups,
                   const char* layer) {
  groups.check(layer);
  const int64_t rows = padded_rows == 0 ? vocab : padded_rows;
  WEAVE_CHECK(rows >= vocab, layer,
              "padded_rows ({}) must be at least the vocabulary ({}); hint: padded_vocab", rows,
              vocab);
  piece_of(rows, groups.pieces, layer, "the padded vocabulary");
  return rows;
}

}  // namespace

VocabularyGroups VocabularyGroups::over_tensor(const dist::Group& tensor, bool sequence_parallel) {
  return {.pieces = tensor, .tensor = tensor, .sequence_parallel = sequence_parallel};
}

void VocabularyGroups::check(const char* op) const {
  const int t = tensor ? tensor->rank() : 0, nb = batches ? batches->size() : 1;
  const int b = batches ? batches->rank() : 0;
  const int64_t count = int64_t(tensor ? tensor->size() : 1) * nb;
  WEAVE_CHECK(pieces.size() == count && pieces.rank() == t * nb + b, op,
              "expected the vocabulary's pieces to be tensor x batches ({} ranks) with this rank "
              "at piece {}, found group {} with this rank at {}; hint: pieces = "
              "mesh.vocabulary(), batches = mesh.shard(), tensor = mesh.tensor()",
              count, t * nb + b, pieces.str(), pieces.rank());
}

int64_t VocabularyGroups::padded(int64_t vocab) const {
  return padded_vocab(vocab, pieces.size());
}

VocabParallelEmbedding::VocabParallelEmbedding(int64_t vocab, int64_t dim, VocabularyGroups groups,
                                               Generator* generator, int64_t padded_rows)
    : ShardedModule("VocabParallelEmbedding", groups.pieces),
      weight(register_parameter("weight", Tensor())),
      groups_(std::move(groups)),
      vocab_(vocab) {
  const int64_t rows = table_rows(vocab, padded_rows, groups_, "VocabParallelEmbedding");
  nn::Embedding full(vocab, dim, generator);  // the unpadded initialization, then zero rows
  weight = split_parameter(pad_rows(full.weight.detach(), rows), 0, group(), vocab,
                           groups_.batches.has_value());
  weight.requires_grad_(true);
}

VocabParallelEmbedding::VocabParallelEmbedding(int64_t vocab, int64_t dim, dist::Group group,
                                               Generator* generator, int64_t padded_rows)
    : VocabParallelEmbedding(vocab, dim, VocabularyGroups::over_tensor(group), generator,
                             padded_rows) {}

Tensor VocabParallelEmbedding::forward(const Tensor& ids) {
  const char* op = "VocabParallelEmbedding";
  if (groups_.batches) check_same_rows(ids, *groups_.batches, op);
  const Tensor all = groups_.batches ? gather_rows(ids, *groups_.batches) : ids;
  const int64_t rows = weight.size(0), start = group().rank() * rows;
  Tensor mine, local;
  {
    NoGradGuard no_grad;
    WEAVE_CHECK(all.numel() == 0 ||
                    (min(all).item<double>() >= 0 && max(all).item<double>() < double(vocab_)),
                op, "ids must lie in [0, {}), found [{}, {}]", vocab_,
                all.numel() ? min(all).item<double>() : 0,
                all.numel() ? max(all).item<double>() : 0);
    Tensor shifted = all.to(kInt64) - double(start);
    Tensor inside = ge(shifted, zeros_like(shifted)).to(kInt64) *
                    lt(shifted, full_like(shifted, double(rows))).to(kInt64);
    mine = ne(inside, zeros_like(inside));
    local = where(mine, shifted, zeros_like(shifted));
  }
  Tensor rows_here = embedding(weight, local) * unsqueeze(mine, -1).to(weight.dtype());
  if (groups_.batches) rows_here = F::reduce_scatter_sum(rows_here, 0, *groups_.batches);
  return groups_.tensor ? F::reduce_from_group(rows_here, *groups_.tensor) : rows_here;
}

VocabParallelHead::VocabParallelHead(int64_t dim, int64_t vocab, VocabularyGroups groups, bool bias,
                                     Generator* generator, int64_t padded_rows)
    : ShardedModule("VocabParallelHead", groups.pieces),
      weight(register_parameter("weight", Tensor())),
      bias(register_parameter("bias", Tensor())),
      groups_(std::move(groups)) {
  const int64_t rows = table_rows(vocab, padded_rows, groups_, "VocabParallelHead");
  nn::Linear full(dim, rows, bias, generator);
  const bool across = groups_.batches.has_value();
  weight = split_parameter(full.weight, 0, group(), vocab, across);
  weight.requires_grad_(true);
  if (!bias) return;
  this->bias = split_parameter(full.bias, 0, group(), vocab, across);
  this->bias.requires_grad_(true);
}

Tensor VocabParallelHead::forward(const Tensor& hidden) {
  return linear(vocabulary_rows(hidden, groups_), weight, bias);
}

Tensor vocabulary_rows(const Tensor& hidden, const VocabularyGroups& groups) {
  Tensor rows = hidden;
  if (groups.batches) {
    check_same_rows(hidden, *groups.batches, "vocabulary_rows");
    rows = F::all_gather(rows, 0, *groups.batches);
  }
  if (!groups.tensor) return rows;
  return groups.sequence_parallel ? F::gather_from_sequence_group(rows, 1, *groups.tensor)
                                  : F::copy_to_group(rows, *groups.tensor);
}

Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets,
                                    const VocabularyGroups& groups, bool mean) {
  const char* op = "vocab_parallel_cross_entropy";
  const int64_t batches = groups.batches ? groups.batches->size() : 1;
  // First the shapes every batch rank passes (the logits' rows are gathered, the same on all):
  // then each check below fails on every rank or on none.
  if (groups.batches) check_same_rows(targets, *groups.batches, op);
  WEAVE_CHECK(
      logits.dim() == 2 && targets.dim() == 1 && targets.size(0) * batches == logits.size(0), op,
      "expected logits [N, V/n] and targets [N / {}] (this rank's rows of the {} ranks "
      "reading batches), found {} and {}",
      batches, batches, logits.shape(), targets.shape());
  WEAVE_CHECK(!is_floating(targets.dtype()), op, "targets must be integer class ids, found {}",
              targets.dtype());
  if (!groups.batches) {
    const Tensor losses = piece_losses(logits, targets, groups.pieces);
    return mean ? losses.mean() : losses.sum();
  }
  Tensor losses = piece_losses(logits, gather_rows(targets, *groups.batches), groups.pieces);
  // Each rank's loss reads its own rows, but every rank's logits feed every row: the rows'
  // gradients are summed over the batch ranks before each rank differentiates its logits.
  losses = F::copy_to_group(losses, *groups.batches)
               .narrow(0, groups.batches->rank() * targets.size(0), targets.size(0));
  return mean ? losses.mean() : losses.sum();
}

Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets,
                                    const dist::Group& group, bool mean) {
  return vocab_parallel_cross_entropy(logits, targets, VocabularyGroups::over_tensor(group), mean);
}

int64_t padded_vocab(int64_t vocab, int n) {
  WEAVE_CHECK(vocab > 0 && n > 0, "padded_vocab",
              "expected a vocabulary and ranks, found {} and {}", vocab, n);
  if (vocab % n == 0) return vocab;
  const int64_t multiple = std::lcm(int64_t{128}, int64_t(n));
  return (vocab + multiple - 1) / multiple * multiple;
}

Tensor vocab_parallel_logits(const Tensor& logits, int64_t vocab, const VocabularyGroups& groups,
                             bool gather) {
  const dist::Group& pieces = groups.pieces;
  const int64_t piece = logits.size(-1), start = pieces.rank() * piece;
  const bool padded = piece * pieces.size() > vocab;
  if (gather) {
    Tensor all = logits;  // [n B, ..., piece]: every batch rank's rows
    if (groups.batches) all = F::all_to_all(all, 0, -1, *groups.batches);
    if (groups.tensor) all = F::all_gather(all, -1, *groups.tensor);
    return padded ? all.narrow(-1, 0, vocab) : all;
  }
  if (!padded || start + piece <= vocab) return logits;
  Tensor past;  // this rank's columns past the vocabulary
  {
    NoGradGuard no_grad;
    past = ge(arange(double(start), double(start + piece), 1.0,
                     {.dtype = kInt64, .device = logits.device()}),
              full({piece}, double(vocab), {.dtype = kInt64, .device = logits.device()}));
  }
  return masked_fill(logits, past, -std::numeric_limits<double>::infinity());
}

Tensor vocab_parallel_logits(const Tensor& logits, int64_t vocab, const dist::Group& group,
                             bool gather) {
  return vocab_parallel_logits(logits, vocab, VocabularyGroups::over_tensor(group), gather);
}

}  // namespace weave::parallel

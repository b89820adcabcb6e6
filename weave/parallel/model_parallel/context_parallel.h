#pragma once
// Context parallelism: attention over a sequence split across the ranks of a context group, for
// contexts whose attention does not fit on one device. Each rank holds its part of q, k and v
// ([B, H, T / n, D]) and gets its part of the output; values and gradients equal
// scaled_dot_product_attention on the whole sequence.
//
//   dist::Group cp = ...;                                          // the context group
//   Tensor q_part = parallel::shard_sequence(q, 2, cp, layout);    // this rank's positions
//   Tensor y_part = parallel::ring_attention(q_part, k_part, v_part, cp,
//                                            {.causal = true, .layout = layout});
//
// Two modes:
//   ring_attention          K/V blocks travel around the ring, each block's exchange overlapping
//                           the attention of the block before it; partial results merge by
//                           their log-sum-exp; in backward dK/dV travel around the ring back to
//                           their owners. Memory per rank: O(T / n).
//   all_to_all_attention    (DeepSpeed-Ulysses) one all_to_all from sequence-sharded to
//                           head-sharded, attention over the whole sequence on H / n heads, one
//                           all_to_all back. Heads must divide by n.
//
// Layouts (where rank r's positions are): Contiguous holds chunk r of n; ZigZag cuts the
// sequence into 2n chunks and holds chunks r and 2n - 1 - r, so that under a causal mask every
// rank does the same attention work. ZigZag is the default everywhere (shard_sequence,
// gather_sequence, ContextSplit, models::ModelSplit): inputs cut in one
// layout and attended in the other would let positions see keys from their future. So a part
// carries how it was cut: shard_sequence records its group, layout and axis on its output, and
// a context-parallel model checks its tokens against its own split (check_sequence_part),
// raising on every rank of the group for a part cut otherwise, or cut by hand with no record
// and no positions that tell. The safe route is ModelSplit::local_inputs (or shard_sequence
// with the split's group and layout).
#include <cstdint>
#include <optional>

#include "weave/distributed/distributed.h"
#include "weave/nn/leaves.h"

namespace weave::parallel {

enum class SequenceLayout { Contiguous, ZigZag };
enum class ContextParallelMode { Ring, AllToAll };

/// A layer's context parallelism: its input holds this rank's part of every sequence, split over
/// `group` in `layout` (shard_sequence), and its attention runs over the whole sequence
/// (ring_attention, or all_to_all_attention).
struct ContextSplit {
  dist::Group group;
  ContextParallelMode mode = ContextParallelMode::Ring;
  SequenceLayout layout = SequenceLayout::ZigZag;
};

/// What the last ring_attention on this thread did: its share of the attention work and the
/// time its compute waited for K/V blocks (the exchange that compute did not hide).
struct RingAttentionStats {
  /// Query-key scores computed by this rank in forward (a causal diagonal block counts its
  /// lower triangle).
  int64_t score_elements = 0;
  /// Seconds forward's compute waited for the next K/V block.
  double exchange_wait_s = 0;
};

struct ContextParallelOptions {
  bool causal = false;
  SequenceLayout layout = SequenceLayout::ZigZag;
  /// Multiplies q k^T; 1 / sqrt(head size) when unset.
  std::optional<double> scale = std::nullopt;
  /// Filled by ring_attention when set.
  RingAttentionStats* stats = nullptr;
  /// Sliding window (with causal), counted in positions of the whole sequence: exact where it
  /// reaches into another rank's chunk; the ring skips the chunks no window reaches.
  int64_t window = 0;
  /// Soft-capped scores, as AttentionOptions::softcap.
  double softcap = 0.0;
  /// Packed sequences: this rank's part of the documents, int32/int64 [B, T / n] or [T / n]
  /// (shard_sequence of the whole sequence's ids, in the same layout). A query attends only to
  /// keys of its own document, wherever they are: a document may straddle ranks. Every rank
  /// passes them or none does.
  Tensor document_ids{};
};

/// Attention over the whole sequence, from this rank's parts of q [B, H, Tq, D], k [B, Hkv, Tk,
/// D] and v [B, Hkv, Tk, Dv] (Tq == Tk, the same on every rank; even under ZigZag; Hkv divides
/// H: grouped-query attention). Collective over the group: every rank calls it with the same
/// shapes and options (or every rank raises).
Tensor ring_attention(const Tensor& q, const Tensor& k, const Tensor& v, const dist::Group& group,
                      const ContextParallelOptions& options = {});

/// The same result through two all_to_alls (the query heads and the key/value heads must
/// divide by the group size).
Tensor all_to_all_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                            const dist::Group& group, const ContextParallelOptions& options = {});

/// Attention over the sequence `split` cuts: ring_attention or all_to_all_attention as its mode
/// says, in its layout (options.layout is ignored).
Tensor context_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                         const ContextSplit& split, ContextParallelOptions options = {});

/// The core attention of the transformer layers of nn/ over a context group (nn/leaves.h): each
/// rank passes its part of every sequence (split.layout), attention runs over the whole sequence
/// (split.mode), and positions left out are the part's place in it. No attention dropout and no
/// decoding with a cache (both raise at construction or call). The layers record on their
/// parameters that the group's ranks read parts of every sequence with them, so a data-parallel
/// wrapper that leaves some out raises.
///
///   nn::GroupedQueryAttention attention(512, {.heads = 8},
///                                       {.attention = parallel::context_parallel({cp})});
class ContextAttention : public nn::CoreAttention {
 public:
  explicit ContextAttention(ContextSplit split) : split_(std::move(split)) {}
  Tensor attend(const Tensor& q, const Tensor& k, const Tensor& v,
                const AttentionOptions& options) const override;
  Tensor positions(int64_t start, int64_t length, Device device) const override;
  void check(const char* layer, bool decoding, bool dropout) const override;
  void place(const nn::Module& layer) const override;
  const ContextSplit& split() const { return split_; }

 private:
  ContextSplit split_;
};
/// ContextAttention over `split` (shared, for nn::Leaves::attention).
std::shared_ptr<const nn::CoreAttention> context_parallel(ContextSplit split);

/// This rank's part of a whole sequence along `axis` (its length must divide by the group size,
/// by twice that under ZigZag), contiguous, recording how it was cut (see above; views and
/// copies of it do not carry the record). Differentiable: the gradient lands in this rank's
/// positions.
Tensor shard_sequence(const Tensor& whole, int64_t axis, const dist::Group& group,
                      SequenceLayout layout = SequenceLayout::ZigZag);
/// Raises on every rank of split.group unless each rank's `tokens` ([B, T] or [T], this rank's
/// part along the last axis) were cut as `split` reads them: shard_sequence's record names the
/// split's group and layout; or, without a record, `positions` of the whole sequence (and no
/// document ids, whose positions restart) run as the layout places this rank's chunks. `who`
/// names the caller. Collective over split.group: one agreement.
void check_sequence_part(const Tensor& tokens, const Tensor& positions, const Tensor& document_ids,
                         const ContextSplit& split, const char* who);

/// The whole sequence from every rank's part (an all_gather, reordered for ZigZag).
/// Differentiable: each rank's part gets the sum of the gradients of its positions.
Tensor gather_sequence(const Tensor& part, int64_t axis, const dist::Group& group,
                       SequenceLayout layout = SequenceLayout::ZigZag);

}  // namespace weave::parallel

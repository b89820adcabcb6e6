#pragma once
// Reproducible gradient reduction (internal): what a data-parallel wrapper built with
// {.reproducible = true} does in place of averaging in floating point.
//
// A float sum depends on its order: 2 ranks and 4 ranks add the same micro-batch gradients in
// other groupings, so their steps differ in the last bits and the runs drift apart. Here every
// micro-batch's gradient, as its backward left it, goes into a binned sum per element
// (kernels/common/binned.h) and is zeroed; at the end of the step the ranks agree on each
// element's window (an all_reduce of its maximum, one byte an element), align to it, and add
// their limbs as integers (an all_reduce, or a reduce_scatter for a sharded optimizer; 16
// bytes an element). The result, divided by the
// number of micro-batches in the step (every rank's), is the same bits at any number of ranks
// and any split of the micro-batches among them, provided each micro-batch's gradient is: the
// same rows, the same kernels (the same thread count), parameters whole on every rank.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "weave/distributed/distributed.h"
#include "weave/nn/module.h"

namespace weave::parallel::detail {

/// Raises on every rank of `group`, naming `owner`, for what the mode cannot make reproducible:
/// a parameter cut across ranks (tensor parallelism's slices, vocabulary pieces, spread experts,
/// pipeline stages, flat shards made before the wrapper) or read in parts of each sequence
/// (context parallelism), whose own reductions add in another order at another layout; or a
/// compute thread count that differs between the ranks. Collective (one agreement).
void check_reproducible(const std::vector<std::string>& names, const std::vector<Tensor>& params,
                        const dist::Group& group, const char* owner);

/// What a reproducible run must keep when its layout changes, which checkpoints record: the
/// compute threads (set by check_reproducible) and the micro-batches' rows (set by the first
/// micro-batch). Adds them to a checkpoint's user entries; nothing when no wrapper of this
/// process is reproducible.
void record_reproducible_run(std::map<std::string, std::string>& user);
/// After a load: raises (naming `op`) when the checkpoint was written by a reproducible run with
/// other compute threads than this one's; its micro-batch rows are checked at this run's first
/// micro-batch. Every rank reads the same entries and raises alike.
void check_reproducible_run(const std::map<std::string, std::string>& user, const char* op);

/// Calls `end` at the end of every backward that reaches one of `params` (a final callback
/// queued by the first post-accumulate-grad hook that backward fires), unless it failed. Hooks
/// installed before a wrapper's own run first, so `end` comes before the wrapper settles.
class BackwardEnds {
 public:
  BackwardEnds(const std::vector<Tensor>& params, std::function<void()> end);
  ~BackwardEnds();
  BackwardEnds(const BackwardEnds&) = delete;
  BackwardEnds& operator=(const BackwardEnds&) = delete;

 private:
  void on_hook();
  std::vector<HookHandle> hooks_;
  std::function<void()> end_;
  bool in_backward_ = false;
};

/// The binned sums of the gradients of `params` over one step's micro-batches. A micro-batch is
/// one backward that reaches the parameters: its end adds what it accumulated into the sums,
/// zeroes those gradients and counts it (end_microbatch), so autograd never adds two
/// micro-batches in float. A backward that fails adds nothing (its wrapper discards the step, or
/// the caller zeroes the gradients).
class ReproducibleGradients {
 public:
  /// The sums are laid out as `params` back to back, their length rounded up to a multiple of
  /// `pad_to` (a reduce-scatter's equal pieces, the flat buffers' padding). `watch`: the end of
  /// every backward calls end_microbatch (BackwardEnds); without it the owner does, for several
  /// sums at once (FSDP's flats).
  ReproducibleGradients(std::vector<Tensor> params, std::string owner, int64_t pad_to = 1,
                        bool watch = true);
  /// fold(), and one more micro-batch.
  void end_microbatch();

  /// A micro-batch's forward (with gradients on): notes its rows (the leading size of its
  /// input), which must be the same for every micro-batch of the run, on every rank.
  void note_rows(const nn::Inputs& inputs);

  /// What the ranks of `group` agree on at the end of a step: how many micro-batches each ran,
  /// whether their rows matched (each rank's own and every other's), plus `flags` (one 0/1 word
  /// each: a failed backward, unused parameters), counted over the ranks. Collective (one
  /// agreement); raises on every rank when the rows differ.
  struct Agreement {
    int64_t microbatches = 0;
    std::vector<int64_t> flagged;  // per flag, the ranks that set it
  };
  /// `outer`: the micro-batches are also counted over these ranks (HSDP's replicas, each
  /// holding one total of its own group).
  Agreement agree(const dist::Group& group, const std::vector<int64_t>& flags = {},
                  const dist::Group* outer = nullptr);

  /// Sums every rank's micro-batches over `group` and writes the sum divided by `microbatches`
  /// into grads[i] (parameter i's gradient, contiguous), then starts the next step's sums.
  /// Collective: an all_reduce of the windows' maximum, one of the limbs.
  void reduce_into(const std::vector<Tensor>& grads, const dist::Group& group,
                   int64_t microbatches);
  /// The same for this rank's piece of the padded sums (elements [rank p, (rank + 1) p) for
  /// p = shard.numel() and the rank in `group`), written into `shard`; with `replicas` (HSDP)
  /// the pieces are then summed over those ranks too. Collective: an all_reduce of the windows'
  /// maximum, a reduce_scatter of the limbs (and over the replicas, the same two all_reduces).
  void reduce_scatter_into(const Tensor& shard, const dist::Group& group, int64_t microbatches,
                           const dist::Group* replicas = nullptr);
  /// Adds the gradients accumulated since the last fold into the sums and zeroes them. The end
  /// of every backward does it; a wrapper that drops the gradients earlier (FSDP, once a unit's
  /// are complete) calls it first.
  void fold();
  /// Drops the step's sums (a failed step).
  void discard();

 private:
  void align(const dist::Group& group);

  std::vector<Tensor> params_;
  std::vector<int64_t> offsets_;
  std::string owner_;
  Tensor window_, limbs_;  // uint8 [n], int64 [2 n]
  int64_t microbatches_ = 0, rows_ = -1, differing_rows_ = -1;
  std::unique_ptr<BackwardEnds> ends_;  // with watch
};

}  // namespace weave::parallel::detail

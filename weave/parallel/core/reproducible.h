#pragma once
// Reproducible gradient reduction (internal): what a data-parallel wrapper built with
// {.reproducible = true} does in place of averaging in floating point.
//
// A float sum depends on its order: 2 ranks and 4 ranks add the same micro-batch gradients in
// other groupings, so their steps differ in the last bits and the runs drift apart. Here every
// micro-batch's gradient, as its backward left it, goes into a binned sum per element
// (kernels/common/binned.h) and is zeroed; at the end of the step the ranks agree on each
// element's window (an all_reduce of its maximum, one byte an element), align to it, and add
// their limbs as integers (an all_reduce, 16 bytes an element). The result, divided by the
// number of micro-batches in the step (every rank's), is the same bits at any number of ranks
// and any split of the micro-batches among them, provided each micro-batch's gradient is: the
// same rows, the same kernels (the same thread count), parameters whole on every rank.
#include <cstdint>
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

/// The binned sums of the gradients of `params` over one step's micro-batches.
class ReproducibleGradients {
 public:
  ReproducibleGradients(std::vector<Tensor> params, std::string owner);

  /// A micro-batch's forward is starting (with gradients on): adds what the previous
  /// micro-batch's backward accumulated into the sums, zeroes those gradients, and counts this
  /// micro-batch, noting its rows (the leading size of its input).
  void begin_microbatch(const nn::Inputs& inputs);
  /// The step's last backward ended: adds what it accumulated, as begin_microbatch does.
  void fold();

  /// What the ranks of `group` agree on at the end of a step: how many micro-batches each ran,
  /// whether their rows matched (each rank's own and every other's), plus `flags` (one 0/1 word
  /// each: a failed backward, unused parameters), counted over the ranks. Collective (one
  /// agreement); raises on every rank when the rows differ.
  struct Agreement {
    int64_t microbatches = 0;
    std::vector<int64_t> flagged;  // per flag, the ranks that set it
  };
  Agreement agree(const dist::Group& group, const std::vector<int64_t>& flags);

  /// Sums every rank's micro-batches over `group` and writes the sum divided by `microbatches`
  /// into grads[i] (parameter i's gradient, contiguous), then starts the next step's sums.
  /// Collective: two all_reduces.
  void reduce_into(const std::vector<Tensor>& grads, const dist::Group& group,
                   int64_t microbatches);
  /// Drops the step's sums (a failed step).
  void discard();

  /// Micro-batches this rank counted since the last reduce_into or discard.
  int64_t local_microbatches() const { return microbatches_; }
  /// The rows of the first micro-batch of the run (-1: none yet).
  int64_t rows() const { return rows_; }

 private:
  std::vector<Tensor> params_;
  std::vector<int64_t> offsets_;
  std::string owner_;
  Tensor window_, limbs_;  // uint8 [n], int64 [2 n]
  int64_t microbatches_ = 0, rows_ = -1;
  bool rows_differ_ = false;
  int64_t differing_rows_ = -1;
};

}  // namespace weave::parallel::detail

#pragma once
// Splitting data across the ranks of a data-parallel job.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "weave/data/dataloader.h"
#include "weave/distributed/distributed.h"

namespace weave::parallel {

struct DistributedSamplerOptions {
  /// Shuffle with a permutation seeded by seed + epoch (the same on every rank).
  bool shuffle = true;
  uint64_t seed = 0;
  /// Drop the tail that does not divide among the ranks; otherwise pad it by wrapping around
  /// to the start, so every rank gets the same number of indices.
  bool drop_last = false;
};

/// Each rank's share of a dataset for one epoch (PyTorch's DistributedSampler): the epoch's
/// order (a seeded permutation, or 0..n-1), padded or trimmed to a multiple of the number of
/// replicas, of which rank r takes positions r, r + replicas, r + 2 * replicas, ... Plug it into
/// data::DataLoader through DataLoaderOptions::sampler, and call set_epoch at every epoch.
class DistributedSampler : public data::Sampler {
 public:
  /// Replicas and rank from a group (default: the world).
  explicit DistributedSampler(int64_t dataset_size, DistributedSamplerOptions options = {},
                              const std::optional<dist::Group>& group = std::nullopt);
  /// Explicit replicas and rank (no distributed runtime needed).
  DistributedSampler(int64_t dataset_size, int replicas, int rank,
                     DistributedSamplerOptions options = {});

  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }
  /// Indices per rank and epoch.
  int64_t size() const override { return per_rank_; }
  /// A shuffling sampler asked for the order of the epoch whose order it drew last warns once
  /// (on replica 0): every epoch then repeats one order, the silent result of a missing
  /// set_epoch, or of a resume that set the finished epoch's number again.
  std::vector<int64_t> indices() override;
  /// The epoch, the seed and the epoch whose order was drawn last (-1: none), as text
  /// (checkpoints): "epoch 3 seed 0 drawn 3". They hold nothing of this rank's, so the state is
  /// valid on every rank of the group.
  std::string state() const override;
  /// Restores state() (also without "drawn", or a bare epoch, as older checkpoints wrote it).
  void load_state(const std::string& state) override;
  bool per_rank() const override { return replicas_ > 1; }
  int replicas() const override { return replicas_; }
  int replica() const override { return rank_; }
  /// The epoch's order without its first `consumed` entries, padded (or trimmed) to a multiple
  /// of the replicas and dealt out as indices() deals the whole order.
  std::vector<int64_t> indices_from(int64_t consumed) override;

 private:
  int64_t dataset_size_;
  int replicas_, rank_;
  DistributedSamplerOptions options_;
  int64_t per_rank_ = 0;
  int64_t epoch_ = 0;
  int64_t drawn_epoch_ = -1;
  bool warned_repeat_ = false;
};

/// This rank's contiguous block [begin, end) of `size` items split over `replicas` ranks as
/// evenly as possible (the first size % replicas ranks get one more).
std::pair<int64_t, int64_t> contiguous_range(int64_t size, int replicas, int rank);

/// A dataset seen through a contiguous block of another (Lux's DistributedDataContainer):
/// rank r of the group gets contiguous_range(dataset.size(), group size, r).
class PartitionedDataset : public data::Dataset {
 public:
  PartitionedDataset(std::shared_ptr<const data::Dataset> dataset,
                     const std::optional<dist::Group>& group = std::nullopt);
  PartitionedDataset(std::shared_ptr<const data::Dataset> dataset, int replicas, int rank);
  int64_t size() const override { return end_ - begin_; }
  data::Example get(int64_t index) const override;
  data::Example get_batch(const std::vector<int64_t>& indices) const override;

 private:
  std::shared_ptr<const data::Dataset> dataset_;
  int64_t begin_ = 0, end_ = 0;
};

/// The micro-batches of one global batch, dealt out by global index (reproducible mode): a
/// global batch of `batch` items is cut into batch / microbatch micro-batches of `microbatch`
/// items, micro-batch i holding items [i microbatch, (i + 1) microbatch) at every layout; rank r
/// of `replicas` runs a contiguous block of them (contiguous_range). So a micro-batch's content
/// never depends on the number of ranks, only which rank runs it.
///
///   parallel::MicroBatchPlan plan(/*batch=*/16, /*microbatch=*/4, mesh.shape().data,
///                                 mesh.data_rank());
///   for (int64_t i = 0; i < plan.local(); ++i) {
///     auto [begin, end] = plan.items(i);                    // of this step's global batch
///     auto guard = i + 1 < plan.local() ? std::optional(ddp.no_sync()) : std::nullopt;
///     cross_entropy(ddp(inputs(begin, end)), targets(begin, end)).backward();
///   }
class MicroBatchPlan {
 public:
  /// Raises unless microbatch divides batch into at least `replicas` micro-batches (every rank
  /// runs one or more).
  MicroBatchPlan(int64_t batch, int64_t microbatch, int replicas, int rank);
  /// Micro-batches in the global batch.
  int64_t count() const { return batch_ / microbatch_; }
  /// This rank's micro-batches.
  int64_t local() const { return last_ - first_; }
  /// The global index of this rank's micro-batch i.
  int64_t global(int64_t i) const { return first_ + i; }
  /// The items [begin, end) of the global batch that this rank's micro-batch i holds.
  std::pair<int64_t, int64_t> items(int64_t i) const;

 private:
  int64_t batch_, microbatch_, first_ = 0, last_ = 0;
};

/// Group rank 0 runs fn first (say, to download or unpack a file), then the other ranks run
/// it. If fn raises on rank 0, every rank raises (nobody is left waiting). Collective.
void rank0_first(const std::function<void()>& fn,
                 const std::optional<dist::Group>& group = std::nullopt);

}  // namespace weave::parallel

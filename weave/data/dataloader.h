#pragma once
// Datasets and a batching loader with seeded shuffling.
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "weave/nn/module.h"
#include "weave/ops/ops.h"

namespace weave::data {

/// One batch (or one example): inputs and targets, and for packed token windows each input
/// token's position in its document and the document's id (undefined otherwise).
struct Example {
  Tensor input;
  Tensor target;
  Tensor positions{};
  Tensor document_ids{};
  /// What a model's forward takes: the input with its positions and document ids.
  nn::Inputs model_inputs() const { return {input, positions, document_ids}; }
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  virtual Example get(int64_t index) const = 0;
  /// The examples at indices stacked along a new first dim. Override when a faster gather
  /// exists (TensorDataset does).
  virtual Example get_batch(const std::vector<int64_t>& indices) const;
};

/// Examples are rows of two tensors with the same first dimension.
class TensorDataset : public Dataset {
 public:
  TensorDataset(Tensor inputs, Tensor targets);
  int64_t size() const override { return inputs_.size(0); }
  Example get(int64_t index) const override;
  Example get_batch(const std::vector<int64_t>& indices) const override;

 private:
  Tensor inputs_, targets_;
};

/// Chooses the dataset indices a pass over the data visits, in order (a distributed sampler
/// gives each rank its share).
class Sampler {
 public:
  virtual ~Sampler() = default;
  /// Number of indices per pass.
  virtual int64_t size() const = 0;
  /// The indices of the next pass (DataLoader::begin() calls it once per epoch).
  virtual std::vector<int64_t> indices() = 0;
  /// What a checkpoint keeps of the sampler (a DistributedSampler's epoch), as text.
  virtual std::string state() const { return ""; }
  /// Restores state(); raises on text it did not write.
  virtual void load_state(const std::string& state) {
    WEAVE_CHECK(state.empty(), "Sampler", "this sampler keeps no state, found '{}'", state);
  }
  /// True when indices() is this rank's share of the data, different on each rank (a
  /// DistributedSampler over several replicas): a loader's order then belongs to one rank.
  virtual bool per_rank() const { return false; }
  /// How many ranks split the data, and this rank's place among them.
  virtual int replicas() const { return 1; }
  virtual int replica() const { return 0; }
  /// This rank's share of the rest of the current epoch, after the first `consumed` entries of
  /// the epoch's order over all replicas: how a loader resumes an epoch that was saved at
  /// another number of replicas.
  virtual std::vector<int64_t> indices_from(int64_t consumed);
};

/// Where a DataLoader stands, for checkpoints: the shuffle generator, the current epoch's order,
/// how many of its batches were handed out, and the sampler's state; and how the data was
/// split (batch size, the sampler's replicas and this rank's place), so that a loader with
/// another split can take up the epoch where the saved one left it (-1: not recorded).
struct LoaderState {
  std::string generator;
  std::vector<int64_t> order;
  int64_t position = 0;
  std::string sampler;
  int64_t batch_size = -1;
  int replicas = -1;
  int replica = -1;
};

/// The most worker threads a DataLoader starts.
inline constexpr int kMaxWorkers = 1024;

struct DataLoaderOptions {
  int64_t batch_size = 64;
  bool shuffle = false;
  bool drop_last = false;
  uint64_t seed = 0;  // shuffle seed: each pass over the data draws the next permutation
  /// Where the indices come from instead of shuffle (e.g. parallel::DistributedSampler).
  std::shared_ptr<Sampler> sampler = nullptr;
  /// Threads that load batches ahead of the training loop (0: each batch is loaded when the
  /// loop asks for it). The batches, their order and the loader's state in checkpoints are the
  /// same either way; an exception a worker meets is raised where the loop takes that batch.
  /// The dataset's get_batch then runs on several threads at once: it must be safe to (a
  /// const method that only reads, as TensorDataset's). At most kMaxWorkers.
  int num_workers = 0;
  /// Batches loaded ahead while the loop works on the current one (with workers).
  int prefetch = 2;
};

/// Iterates over batches: `for (const Example& batch : loader)`. Every begin() starts a new
/// epoch; with shuffle, epoch e's order is the same on every run with the same seed.
class DataLoader {
 public:
  DataLoader(std::shared_ptr<const Dataset> dataset, DataLoaderOptions options);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;
  /// Number of batches per epoch.
  int64_t size() const;
  const DataLoaderOptions& options() const { return options_; }

  class Iterator {
   public:
    using value_type = Example;
    using difference_type = std::ptrdiff_t;
    Iterator(const DataLoader* loader, int64_t batch) : loader_(loader), batch_(batch) {}
    const Example& operator*();
    Iterator& operator++() {
      ++batch_;
      loaded_ = false;
      return *this;
    }
    bool operator==(const Iterator& other) const { return batch_ == other.batch_; }

   private:
    const DataLoader* loader_;
    int64_t batch_;
    bool loaded_ = false;
    Example current_;
  };
  Iterator begin();
  Iterator end() const { return Iterator(this, size()); }

  /// Where the loader stands. Saved in the middle of an epoch, the next begin() after
  /// load_state() continues that epoch at the next batch; saved after an epoch, it starts the
  /// next one with the permutation an uninterrupted run would draw. The epoch number a program
  /// saves beside it (for Sampler::set_epoch after the load) must be the one the next batch
  /// belongs to: after an epoch's last batch, the next epoch's number.
  ///
  /// A state saved with another number of replicas (a DistributedSampler over another data-
  /// parallel size) resumes the epoch at the same place in its global order: the examples the
  /// saved run had consumed (position x batch size x replicas) are skipped, and the rest is
  /// split anew among this loader's replicas (Sampler::indices_from).
  LoaderState state() const;
  /// Raises (changing nothing) unless `state` fits this loader's dataset and batch size.
  void check_state(const LoaderState& state) const;
  void load_state(const LoaderState& state);
  /// Whether `state` was saved with another number of replicas (load_state re-splits it).
  bool resplits(const LoaderState& state) const;

 private:
  Example load(int64_t batch) const;
  // Batch `batch` of this epoch: loaded now, or taken from the workers (which are asked for the
  // next `prefetch` batches at the same time).
  Example take(int64_t batch) const;
  std::vector<int64_t> indices_of(int64_t batch) const;
  std::shared_ptr<const Dataset> dataset_;
  struct Workers;
  std::unique_ptr<Workers> workers_;
  DataLoaderOptions options_;
  std::mt19937_64 engine_;
  std::vector<int64_t> order_;
  mutable int64_t position_ = 0;  // batches of this epoch handed out
  bool resume_ = false;           // the next begin() continues at position_
};

}  // namespace weave::data

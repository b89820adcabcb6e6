// DistributedSampler, contiguous partitions and rank0_first.
#include "weave/parallel/data_parallel/sampler.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

#include "weave/parallel/core/agree.h"
#include "weave/parallel/core/mesh.h"

namespace weave::parallel {

namespace {
// The data-parallel group's size and this rank's place in it.
std::pair<int, int> replicas_and_rank(const std::optional<dist::Group>& group, const char* op) {
  const dist::Group g = detail::data_parallel_group(group, op);
  return {g.size(), g.rank()};
}
}  // namespace

DistributedSampler::DistributedSampler(int64_t dataset_size, DistributedSamplerOptions options,
                                       const std::optional<dist::Group>& group)
    : DistributedSampler(dataset_size, replicas_and_rank(group, "DistributedSampler").first,
                         replicas_and_rank(group, "DistributedSampler").second, options) {}

DistributedSampler::DistributedSampler(int64_t dataset_size, int replicas, int rank,
                                       DistributedSamplerOptions options)
    : dataset_size_(dataset_size), replicas_(replicas), rank_(rank), options_(options) {
  WEAVE_CHECK(dataset_size >= 0, "DistributedSampler", "dataset size must be >= 0, found {}",
              dataset_size);
  WEAVE_CHECK(replicas > 0 && rank >= 0 && rank < replicas, "DistributedSampler",
              "rank {} of {} replicas is out of range; hint: is this rank in the group?", rank,
              replicas);
  per_rank_ =
      options.drop_last ? dataset_size / replicas : (dataset_size + replicas - 1) / replicas;
}

std::string DistributedSampler::state() const {
  return fmt::format("epoch {} seed {} drawn {}", epoch_, options_.seed, drawn_epoch_);
}

void DistributedSampler::load_state(const std::string& state) {
  long long epoch = -1, drawn = -1;
  unsigned long long seed = options_.seed;
  int consumed = 0;
  auto whole = [&](int fields, int expected) {
    return fields == expected && size_t(consumed) == state.size();
  };
  const bool parsed =
      whole(std::sscanf(state.c_str(), "%lld%n", &epoch, &consumed), 1) ||
      whole(std::sscanf(state.c_str(), "epoch %lld seed %llu%n", &epoch, &seed, &consumed), 2) ||
      whole(std::sscanf(state.c_str(), "epoch %lld seed %llu drawn %lld%n", &epoch, &seed, &drawn,
                        &consumed),
            3);
  WEAVE_CHECK(parsed && epoch >= 0 && drawn >= -1, "DistributedSampler",
              "'{}' is not a saved sampler state (expected 'epoch <e> seed <s> drawn <d>')", state);
  epoch_ = epoch;
  options_.seed = seed;
  drawn_epoch_ = drawn;
}

std::vector<int64_t> DistributedSampler::indices() {
  if (options_.shuffle && drawn_epoch_ == epoch_ && !warned_repeat_) {
    warned_repeat_ = true;
    if (rank_ == 0)
      std::fprintf(stderr,
                   "[weave] warning: DistributedSampler: a new pass over epoch %lld, whose order "
                   "the last pass used too; every epoch repeats one order unless set_epoch "
                   "changes it; hint: call set_epoch(epoch) before each epoch, and after resuming "
                   "from a checkpoint saved after an epoch's last batch, the next epoch's number\n",
                   static_cast<long long>(epoch_));
  }
  return indices_from(0);
}

std::vector<int64_t> DistributedSampler::indices_from(int64_t consumed) {
  drawn_epoch_ = epoch_;
  std::vector<int64_t> order(static_cast<size_t>(dataset_size_));
  for (int64_t i = 0; i < dataset_size_; ++i) order[size_t(i)] = i;
  if (options_.shuffle) {
    // Fisher-Yates with our own draws: the same permutation on every rank and platform.
    std::mt19937_64 engine(options_.seed + uint64_t(epoch_));
    for (int64_t i = dataset_size_ - 1; i > 0; --i)
      std::swap(order[size_t(i)], order[size_t(engine() % uint64_t(i + 1))]);
  }
  const int64_t skipped = std::clamp<int64_t>(consumed, 0, dataset_size_);
  const int64_t left = dataset_size_ - skipped;
  const int64_t per_rank =
      consumed == 0 ? per_rank_
                    : (options_.drop_last ? left / replicas_ : (left + replicas_ - 1) / replicas_);
  const int64_t total = per_rank * replicas_;
  std::vector<int64_t> rest(order.begin() + skipped, order.end());
  // Pad by wrapping around the epoch's order (repeatedly, if the dataset is smaller than the
  // padding), or trim.
  for (int64_t i = 0; int64_t(rest.size()) < total; ++i)
    rest.push_back(order[size_t(i % dataset_size_)]);
  rest.resize(size_t(total));
  std::vector<int64_t> mine;
  mine.reserve(size_t(per_rank));
  for (int64_t i = rank_; i < total; i += replicas_) mine.push_back(rest[size_t(i)]);
  return mine;
}

std::pair<int64_t, int64_t> contiguous_range(int64_t size, int replicas, int rank) {
  WEAVE_CHECK(size >= 0 && replicas > 0 && rank >= 0 && rank < replicas, "contiguous_range",
              "expected size >= 0 and 0 <= rank < replicas, found size {}, rank {}, replicas {}",
              size, rank, replicas);
  const int64_t base = size / replicas, extra = size % replicas;
  const int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

MicroBatchPlan::MicroBatchPlan(int64_t batch, int64_t microbatch, int replicas, int rank)
    : batch_(batch), microbatch_(microbatch) {
  WEAVE_CHECK(microbatch > 0 && batch > 0 && batch % microbatch == 0, "MicroBatchPlan",
              "the global batch ({} items) must be a positive multiple of the micro-batch ({} "
              "items); hint: a micro-batch size that divides the batch at every layout",
              batch, microbatch);
  WEAVE_CHECK(batch / microbatch >= replicas, "MicroBatchPlan",
              "{} micro-batches ({} items of {}) leave some of the {} ranks without one; hint: "
              "smaller micro-batches or fewer data-parallel ranks",
              batch / microbatch, batch, microbatch, replicas);
  std::tie(first_, last_) = contiguous_range(batch / microbatch, replicas, rank);
}

std::pair<int64_t, int64_t> MicroBatchPlan::items(int64_t i) const {
  WEAVE_CHECK(i >= 0 && i < local(), "MicroBatchPlan",
              "micro-batch {} of this rank's {} does not exist", i, local());
  return {global(i) * microbatch_, (global(i) + 1) * microbatch_};
}

PartitionedDataset::PartitionedDataset(std::shared_ptr<const data::Dataset> dataset,
                                       const std::optional<dist::Group>& group)
    : PartitionedDataset(std::move(dataset), replicas_and_rank(group, "PartitionedDataset").first,
                         replicas_and_rank(group, "PartitionedDataset").second) {}

PartitionedDataset::PartitionedDataset(std::shared_ptr<const data::Dataset> dataset, int replicas,
                                       int rank)
    : dataset_(std::move(dataset)) {
  WEAVE_CHECK(dataset_ != nullptr, "PartitionedDataset", "dataset is null");
  std::tie(begin_, end_) = contiguous_range(dataset_->size(), replicas, rank);
}

data::Example PartitionedDataset::get(int64_t index) const {
  WEAVE_CHECK(index >= 0 && index < size(), "PartitionedDataset", "index {} out of range [0, {})",
              index, size());
  return dataset_->get(begin_ + index);
}

data::Example PartitionedDataset::get_batch(const std::vector<int64_t>& indices) const {
  std::vector<int64_t> shifted;
  shifted.reserve(indices.size());
  for (int64_t i : indices) {
    WEAVE_CHECK(i >= 0 && i < size(), "PartitionedDataset", "index {} out of range [0, {})", i,
                size());
    shifted.push_back(begin_ + i);
  }
  return dataset_->get_batch(shifted);
}

void rank0_first(const std::function<void()>& fn, const std::optional<dist::Group>& group_option) {
  const dist::Group group = group_option ? *group_option : dist::world();
  std::string failure;
  if (group.rank() == 0) {
    try {
      fn();
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  // The others wait here until rank 0 is done, then learn whether (and why) it failed.
  failure = detail::broadcast_bytes(failure, 0, group);
  WEAVE_CHECK(failure.empty(), "rank0_first", "the first rank (global rank {}) failed: {}",
              group.global_rank(0), failure);
  if (group.rank() != 0) fn();
}

}  // namespace weave::parallel

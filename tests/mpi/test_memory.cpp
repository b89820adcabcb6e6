// Memory every rank can see: the worst rank's tensor and resident peaks over a group
// (dist::max_memory_stats), and the large reduce-scatters and all-gathers the MPI backend sends
// in chunks (WEAVE_MPI_CHUNK_MB; CTest runs this suite and the collectives' with tiny chunks
// too), against values every rank computes itself.
#include <doctest/doctest.h>

#include <vector>

#include "helpers.h"

using namespace weave;

namespace {

// Row r of every rank's reduce-scatter input: rank s's value at element i of block r.
double value_at(int s, int64_t r, int64_t i) {
  return double(s * 7 + r * 3) + double(i % 1013);
}

}  // namespace

TEST_SUITE("memory") {
  TEST_CASE("max_memory_stats: the largest tensor and resident peaks and the ranks holding them") {
    const int n = dist::world_size(), me = dist::rank();
    cpu_empty_cache();
    reset_peak_memory();
    constexpr int64_t kStep = int64_t(48) << 20;  // bytes more on each higher rank
    {
      Tensor held = ones({(me + 1) * kStep / 8}, {.dtype = kFloat64});  // touched: resident
      const MemoryStats mine = memory_stats();  // read before: the call itself may add some
      const MemoryPeaks worst = dist::max_memory_stats();
      CHECK(worst.tensor_peak >= size_t(n * kStep));
      CHECK(worst.tensor_peak >= mine.peak);
      CHECK(worst.tensor_rank == n - 1);
      CHECK(worst.resident_peak >= mine.resident_peak);
      CHECK(worst.resident_rank == n - 1);
    }
    // Over a group of the even ranks only: their own worst, named by global rank.
    std::vector<std::vector<int>> halves(2);
    for (int r = 0; r < n; ++r) halves[size_t(r % 2)].push_back(r);
    if (n == 1) halves.pop_back();
    const dist::Group mine = dist::split_group(dist::world(), halves);
    const MemoryPeaks within = dist::max_memory_stats(kCPU, mine);
    CHECK(within.tensor_rank == mine.global_rank(mine.size() - 1));
    CHECK(within.tensor_rank % 2 == me % 2);
    cpu_empty_cache();
  }

  TEST_CASE("reduce-scatters and all-gathers past the chunk size land as whole ones do") {
    const int n = dist::world_size(), me = dist::rank();
    // Past the default 16 MB over all ranks, and not a whole number of chunks.
    const int64_t count = (int64_t(20) << 20) / (8 * n) + 517;
    Tensor input = empty({n * count}, {.dtype = kFloat64});
    {
      std::vector<double> values(size_t(n * count));
      for (int64_t r = 0; r < n; ++r)
        for (int64_t i = 0; i < count; ++i) values[size_t(r * count + i)] = value_at(me, r, i);
      input = from_vector(values).reshape({n * count});
    }
    Tensor reduced = empty({count}, {.dtype = kFloat64});
    dist::reduce_scatter(reduced, input, dist::ReduceOp::Sum);
    std::vector<double> expected(size_t(count), 0.0);
    for (int s = 0; s < n; ++s)
      for (int64_t i = 0; i < count; ++i) expected[size_t(i)] += value_at(s, me, i);
    CHECK(equal(reduced, from_vector(expected)));
    // Gathered back: every rank's reduced block in rank order, in place and not.
    Tensor gathered = empty({n * count}, {.dtype = kFloat64});
    dist::all_gather(gathered, reduced);
    Tensor in_place = zeros({n * count}, {.dtype = kFloat64});
    in_place.narrow(0, me * count, count).copy_(reduced);
    dist::all_gather(in_place, in_place.narrow(0, me * count, count));
    for (int r = 0; r < n; ++r) {
      std::vector<double> block(size_t(count), 0.0);
      for (int s = 0; s < n; ++s)
        for (int64_t i = 0; i < count; ++i) block[size_t(i)] += value_at(s, r, i);
      CAPTURE(r);
      CHECK(equal(gathered.narrow(0, r * count, count), from_vector(block)));
      CHECK(equal(in_place.narrow(0, r * count, count), from_vector(block)));
    }
  }
}

// Sharded checkpoint save and load times under mpirun: a 100M-parameter float32 model split
// over the ranks (each rank saves and loads its 1/N, as a tensor- or fully-sharded layout
// holds it), saved synchronously and asynchronously, alternating, medians (rank 0 prints):
//   mpirun -np 2 bench_checkpoint [repetitions=3] [millions of parameters=100] [dir]
// For the asynchronous save, `blocked` is the time the call keeps the training loop (the copy
// to host memory); `wait` is the rest, until the commit (the background write).
#include <weave/weave.h>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>

#include "bench_dist.h"
#include "bench_util.h"

using namespace weave;

int main(int argc, char** argv) {
  set_num_threads(1);
  dist::InitGuard guard;
  const int reps = argc > 1 ? std::stoi(argv[1]) : 3;
  const int64_t millions = argc > 2 ? std::stoll(argv[2]) : 100;
  const int n = dist::world_size();
  Tensor id = full({1}, double(getpid()), {.dtype = kInt64});
  dist::broadcast(id, 0);
  const std::string dir = argc > 3 ? argv[3]
                                   : (std::filesystem::temp_directory_path() /
                                      fmt::format("weave_bench_checkpoint_{}", id.item<int64_t>()))
                                         .string();
  // This rank's share: layers of 1024 x 1024 (+ bias) up to millions * 1e6 / n parameters.
  nn::Sequential model;
  int64_t parameters = 0;
  manual_seed(uint64_t(dist::rank()));
  while (parameters < millions * 1000000 / n) {
    model.push_back(std::make_shared<nn::Linear>(1024, 1024));
    parameters += 1024 * 1024 + 1024;
  }
  data::TrainingState state{.model = &model};
  std::vector<double> sync, blocked, wait, load;
  for (int r = 0; r < reps + 1; ++r) {
    dist::barrier();
    const double s = bench::max_over_ranks(
        bench::seconds([&] { parallel::save_sharded_checkpoint(dir, state); }));
    dist::barrier();
    const double b = bench::max_over_ranks(bench::seconds(
        [&] { parallel::save_sharded_checkpoint(dir, state, dist::world(), {.async = true}); }));
    const double w = bench::max_over_ranks(bench::seconds([] { parallel::wait_for_checkpoint(); }));
    dist::barrier();
    const double l = bench::max_over_ranks(
        bench::seconds([&] { parallel::load_sharded_checkpoint(dir, state); }));
    if (r == 0) continue;  // warm-up
    sync.push_back(s), blocked.push_back(b), wait.push_back(w), load.push_back(l);
  }
  const auto bytes = std::filesystem::file_size(
      fmt::format("{}/rank-{:05d}-of-{:05d}.g{}.safetensors", dir, dist::rank(), n, 2 * reps + 2));
  dist::barrier();
  if (dist::rank() == 0) {
    std::printf("ranks=%d parameters=%lld per_rank=%lld file_mb=%.1f repetitions=%d\n", n,
                static_cast<long long>(parameters * n), static_cast<long long>(parameters),
                double(bytes) / 1e6, reps);
    const double s = bench::median(sync), b = bench::median(blocked);
    std::printf(
        "sync_save_ms=%.1f async_blocked_ms=%.1f async_wait_ms=%.1f load_ms=%.1f "
        "bytes_read_per_rank_mb=%.1f\n",
        s * 1e3, b * 1e3, bench::median(wait) * 1e3, bench::median(load) * 1e3,
        double(bytes) / 1e6);
    std::printf("target blocked/sync=%.3f (<= 0.10): %s\n", b / s, b <= 0.1 * s ? "met" : "MISSED");
    std::filesystem::remove_all(dir);
  }
  return 0;
}

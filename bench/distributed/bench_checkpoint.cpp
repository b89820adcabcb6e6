// Sharded checkpoint save and load times under mpirun: a 100M-parameter float32 model of
// 1024 x 1024 layers split over the ranks by rows (tensor parallel: each rank saves and loads
// its 1/N), saved synchronously and asynchronously, loaded at the same layout and resharded
// (into the same layers under FSDP: a flat slice of each layer, which crosses the saved row
// split), alternating, medians (rank 0 prints):
//   mpirun -np 2 bench_checkpoint [repetitions=3] [millions of parameters=100] [dir]
// For the asynchronous save, `blocked` is the time the call keeps the training loop (the copy
// to host memory); `wait` is the rest, until the commit (the background write). Each load
// reports the bytes it read per rank against the bytes of what the rank needed.
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
  // Layers of 1024 x 1024 (+ bias) up to millions * 1e6 parameters in all, split by rows.
  const int64_t layers = (millions * 1000000 + 1024 * 1025 - 1) / (1024 * 1025);
  const int64_t parameters = layers * 1024 * 1025;
  manual_seed(7);
  nn::Sequential model;
  for (int64_t k = 0; k < layers; ++k)
    model.push_back(std::make_shared<parallel::ColumnParallelLinear>(1024, 1024, dist::world()));
  data::TrainingState state{.model = &model};
  // The same layers unsplit, under FSDP: each rank holds half of every layer, flattened.
  manual_seed(8);
  nn::Sequential whole;
  for (int64_t k = 0; k < layers; ++k) whole.push_back(std::make_shared<nn::Linear>(1024, 1024));
  parallel::FullyShardedDataParallel fsdp(whole);
  data::TrainingState resharded{.model = &fsdp.sharded_module()};
  std::vector<double> sync, blocked, wait, load, reshard;
  parallel::ShardedLoadReport same_report, reshard_report;
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
        bench::seconds([&] { same_report = parallel::load_sharded_checkpoint(dir, state); }));
    dist::barrier();
    const double x = bench::max_over_ranks(bench::seconds(
        [&] { reshard_report = parallel::load_sharded_checkpoint(dir, resharded); }));
    if (r == 0) continue;  // warm-up
    sync.push_back(s), blocked.push_back(b), wait.push_back(w), load.push_back(l);
    reshard.push_back(x);
  }
  // The most any rank read, against what that rank needed.
  auto worst_ratio = [](const parallel::ShardedLoadReport& report) {
    return bench::max_over_ranks(double(report.bytes_read) / double(report.bytes_needed));
  };
  const double same_ratio = worst_ratio(same_report), reshard_ratio = worst_ratio(reshard_report);
  const double same_read = bench::max_over_ranks(double(same_report.bytes_read));
  const double reshard_read = bench::max_over_ranks(double(reshard_report.bytes_read));
  const auto bytes = std::filesystem::file_size(
      fmt::format("{}/rank-{:05d}-of-{:05d}.g{}.safetensors", dir, dist::rank(), n, 2 * reps + 2));
  dist::barrier();
  if (dist::rank() == 0) {
    std::printf("ranks=%d parameters=%lld per_rank=%lld file_mb=%.1f repetitions=%d\n", n,
                static_cast<long long>(parameters), static_cast<long long>(parameters / n),
                double(bytes) / 1e6, reps);
    const double s = bench::median(sync), b = bench::median(blocked);
    std::printf("sync_save_ms=%.1f async_blocked_ms=%.1f async_wait_ms=%.1f\n", s * 1e3, b * 1e3,
                bench::median(wait) * 1e3);
    std::printf("load_same_layout_ms=%.1f read_mb=%.1f read/needed=%.3f\n",
                bench::median(load) * 1e3, same_read / 1e6, same_ratio);
    std::printf("load_resharded_ms=%.1f read_mb=%.1f read/needed=%.3f\n",
                bench::median(reshard) * 1e3, reshard_read / 1e6, reshard_ratio);
    std::printf("target blocked/sync=%.3f (<= 0.10): %s\n", b / s, b <= 0.1 * s ? "met" : "MISSED");
    std::printf("target resharded read/needed=%.3f (<= 1.10): %s\n", reshard_ratio,
                reshard_ratio <= 1.1 ? "met" : "MISSED");
    std::filesystem::remove_all(dir);
  }
  return 0;
}

// Context parallelism against one rank on the same total sequence: forward + backward of causal
// attention over T positions, split over the ranks by ring attention (zig-zag parts) and by
// all-to-all attention, against scaled_dot_product_attention of the whole sequence on rank 0
// alone (the other ranks wait). Cases alternate; medians of repetitions; rank 0 prints:
//   mpirun -np 2 bench_context [repetitions=7] [T=4096] [heads=8] [head_dim=64]
// The ring's exchange share: forward's K/V exchanges take (ranks - 1) block transfers; the time
// forward's compute waited for them (RingAttentionStats::exchange_wait_s) over the time the same
// transfers take alone is the part not hidden behind compute.
#include <weave/weave.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bench_dist.h"
#include "bench_util.h"

using namespace weave;

namespace {

Tensor part_of(const Tensor& whole, const dist::Group& world) {
  return parallel::shard_sequence(whole, 2, world, parallel::SequenceLayout::ZigZag)
      .contiguous()
      .requires_grad_(true);
}

// One K/V block's trip to the next rank, alone (what the ring overlaps with compute).
double transfer_seconds(int64_t elements, int repetitions) {
  const int n = dist::world_size(), r = dist::rank();
  Tensor out = zeros({elements}), in = zeros({elements});
  std::vector<double> times;
  for (int i = 0; i < repetitions + 1; ++i) {
    dist::barrier();
    const double t = bench::seconds([&] {
      dist::Work send = dist::isend(out, (r + 1) % n, dist::world(), 9);
      dist::recv(in, (r + n - 1) % n, dist::world(), 9);
      send.wait();
    });
    if (i > 0) times.push_back(bench::max_over_ranks(t));
  }
  return bench::median(times);
}

}  // namespace

int main(int argc, char** argv) {
  dist::InitGuard distributed;
  set_num_threads(1);
  const int repetitions = argc > 1 ? std::atoi(argv[1]) : 7;
  const int64_t t = argc > 2 ? std::atoll(argv[2]) : 4096, h = argc > 3 ? std::atoll(argv[3]) : 8,
                d = argc > 4 ? std::atoll(argv[4]) : 64;
  const int n = dist::world_size();
  const dist::Group world = dist::world();
  Generator g(1);
  const Tensor q = randn({1, h, t, d}, {}, &g), k = randn({1, h, t, d}, {}, &g),
               v = randn({1, h, t, d}, {}, &g);
  Tensor qp = part_of(q, world), kp = part_of(k, world), vp = part_of(v, world);
  parallel::RingAttentionStats stats;
  std::vector<double> ring, all_to_all, single, waited;
  auto timed_max = [](const std::function<void()>& fn) {
    dist::barrier();
    return bench::max_over_ranks(bench::seconds(fn));
  };
  for (int i = 0; i < repetitions + 1; ++i) {
    const double a = timed_max([&] {
      parallel::ring_attention(
          qp, kp, vp, world,
          {.causal = true, .layout = parallel::SequenceLayout::ZigZag, .stats = &stats})
          .sum()
          .backward();
    });
    const double wait = bench::max_over_ranks(stats.exchange_wait_s);
    const double b = timed_max([&] {
      parallel::all_to_all_attention(qp, kp, vp, world,
                                     {.causal = true, .layout = parallel::SequenceLayout::ZigZag})
          .sum()
          .backward();
    });
    const double c = timed_max([&] {
      if (dist::rank() != 0) return;
      Tensor qw = q.clone().requires_grad_(true), kw = k.clone().requires_grad_(true),
             vw = v.clone().requires_grad_(true);
      scaled_dot_product_attention(qw, kw, vw, {.causal = true}).sum().backward();
    });
    if (i == 0) continue;  // warm-up
    ring.push_back(a), all_to_all.push_back(b), single.push_back(c), waited.push_back(wait);
  }
  const double exchange = double(n - 1) * transfer_seconds(2 * kp.numel(), repetitions);
  if (dist::rank() == 0) {
    const double one = bench::median(single);
    std::printf("causal attention, T=%lld, %lld heads of %lld, float32, %d ranks, 1 thread each\n",
                static_cast<long long>(t), static_cast<long long>(h), static_cast<long long>(d), n);
    std::printf("  one rank, whole sequence     %8.1f ms\n", 1e3 * one);
    std::printf("  ring attention (zig-zag)     %8.1f ms  %.2fx faster than one rank\n",
                1e3 * bench::median(ring), one / bench::median(ring));
    std::printf("  all-to-all attention         %8.1f ms  %.2fx faster than one rank\n",
                1e3 * bench::median(all_to_all), one / bench::median(all_to_all));
    std::printf(
        "  ring forward K/V exchange: %.2f ms alone, compute waited %.2f ms: %.0f%% hidden\n",
        1e3 * exchange, 1e3 * bench::median(waited),
        exchange > 0 ? 100.0 * (1.0 - bench::median(waited) / exchange) : 100.0);
  }
  return 0;
}

// The mixture-of-experts layer spread over the ranks against the same layer on one rank: forward
// + backward of parallel::ExpertParallelMoE (experts over the world, each rank its own tokens)
// and of nn::MoE (every expert on the rank, the same tokens), alternating, medians; rank 0
// prints the times and the bytes the dispatch and combine moved:
//   mpirun -np 2 bench_moe [repetitions=7] [tokens per rank=4096] [hidden=256] [experts=8]
//                          [top_k=2]
#include <weave/weave.h>

#include <cstdio>
#include <cstdlib>

#include "bench_dist.h"
#include "bench_util.h"

using namespace weave;

int main(int argc, char** argv) {
  dist::InitGuard distributed;
  set_num_threads(1);
  const int repetitions = argc > 1 ? std::atoi(argv[1]) : 7;
  const int64_t tokens = argc > 2 ? std::atoll(argv[2]) : 4096,
                hidden = argc > 3 ? std::atoll(argv[3]) : 256,
                experts = argc > 4 ? std::atoll(argv[4]) : 8,
                top_k = argc > 5 ? std::atoll(argv[5]) : 2;
  const nn::MoEOptions options{.hidden = hidden,
                               .ffn = 4 * hidden / top_k,
                               .router = {.experts = experts, .top_k = top_k},
                               .seed = 1};
  parallel::ExpertParallelMoE spread(options, dist::world());
  nn::MoE dense(options);
  Generator g(uint64_t(dist::rank()) + 2);
  const Tensor x = randn({tokens, hidden}, {}, &g);
  auto step = [&](nn::Module& layer) {
    dist::barrier();
    return bench::max_over_ranks(bench::seconds([&] { layer(x).sum().backward(); }));
  };
  std::vector<double> spread_s, dense_s;
  for (int i = 0; i < repetitions + 1; ++i) {
    const double a = step(spread), b = step(dense);
    if (i > 0) spread_s.push_back(a), dense_s.push_back(b);
  }
  const nn::MoEStats& s = spread.stats();
  if (dist::rank() == 0) {
    const double a = bench::median(spread_s), b = bench::median(dense_s);
    std::printf(
        "MoE layer, %lld tokens per rank, hidden %lld, %lld experts (ffn %lld), top %lld, "
        "float32, %d ranks, 1 thread each\n",
        static_cast<long long>(tokens), static_cast<long long>(hidden),
        static_cast<long long>(experts), static_cast<long long>(options.ffn),
        static_cast<long long>(top_k), dist::world_size());
    std::printf("  dense (every expert here)      %8.1f ms\n", 1e3 * b);
    std::printf("  expert-parallel                %8.1f ms  (%.2fx the dense layer)\n", 1e3 * a,
                a / b);
    std::printf(
        "  rank 0 sent %lld and received %lld rows in the dispatch; %.1f MB moved per "
        "step (dispatch and combine, forward and backward)\n",
        static_cast<long long>(s.rows_sent), static_cast<long long>(s.rows_received),
        2.0 * double(s.bytes_exchanged) / 1e6);
  }
  return 0;
}

// The mixture-of-experts layer against its physical yardstick and the loop it replaces: forward +
// backward of nn::MoE with its experts as grouped GEMMs over the rows sorted by expert, of the
// same layer running each expert as its own module (MoEOptions::grouped = false), and of a
// dense SwiGLU MLP of the same active width (top_k * ffn, plus the shared expert's) on the same
// tokens; SwiGLU experts, float32, one thread per rank, the three alternating, medians. At
// several ranks the experts are spread over the world (expert parallelism), each rank its own
// tokens, and each time is the slowest rank's:
//   mpirun -np 2 bench_moe [repetitions=7] [tokens per rank=2048] [hidden=512] [case=all]
// Cases (experts, top_k, ffn, shared ffn): (8, 2, 1024, 0), (64, 8, 256, 0), (64, 8, 256, 256):
// an active width of 2048 (2304 with the shared expert), hidden 512.
#include <weave/weave.h>

#include <cstdio>
#include <cstdlib>

#include "bench_dist.h"
#include "bench_util.h"

using namespace weave;

namespace {

struct Case {
  int64_t experts, top_k, ffn, shared_ffn;
};

std::shared_ptr<nn::MoE> make_layer(const nn::MoEOptions& options) {
  if (dist::world_size() == 1) return std::make_shared<nn::MoE>(options);
  return std::make_shared<parallel::ExpertParallelMoE>(options, dist::world());
}

}  // namespace

int main(int argc, char** argv) {
  dist::InitGuard distributed;
  set_num_threads(1);
  const int repetitions = argc > 1 ? std::atoi(argv[1]) : 7;
  const int64_t tokens = argc > 2 ? std::atoll(argv[2]) : 2048,
                hidden = argc > 3 ? std::atoll(argv[3]) : 512;
  const int only = argc > 4 ? std::atoi(argv[4]) : -1;  // one case's index, for a profile
  Generator g(uint64_t(dist::rank()) + 2);
  const Tensor x = randn({tokens, hidden}, {}, &g);
  if (dist::rank() == 0)
    std::printf(
        "MoE layer forward + backward, %lld tokens per rank, hidden %lld, SwiGLU experts, "
        "float32, %d rank(s)%s, 1 thread each; medians of %d alternating runs (ms)\n"
        "%-34s %9s %9s %9s %11s %11s\n",
        static_cast<long long>(tokens), static_cast<long long>(hidden), dist::world_size(),
        dist::world_size() > 1 ? " (experts spread over all)" : "", repetitions,
        "case (experts, top_k, ffn, shared)", "grouped", "loop", "dense", "grouped/den",
        "loop/grouped");
  const std::vector<Case> cases{{8, 2, 1024, 0}, {64, 8, 256, 0}, {64, 8, 256, 256}};
  for (size_t index = 0; index < cases.size(); ++index) {
    if (only >= 0 && size_t(only) != index) continue;
    const Case& c = cases[index];
    nn::MoEOptions options{.hidden = hidden,
                           .ffn = c.ffn,
                           .router = {.experts = c.experts, .top_k = c.top_k},
                           .seed = 1,
                           .gated = true,
                           .shared_ffn = c.shared_ffn};
    const std::shared_ptr<nn::MoE> grouped = make_layer(options);
    options.grouped = false;
    const std::shared_ptr<nn::MoE> loop = make_layer(options);
    nn::GatedMLP dense(hidden, c.top_k * c.ffn + c.shared_ffn);
    // A training step's forward and backward: the gradients start unset, as after an
    // optimizer's zero_grad(set_to_none).
    const auto step_moe = [&](nn::MoE& layer) {
      layer.zero_grad();
      dist::barrier();
      return bench::max_over_ranks(
          bench::seconds([&] { (layer(x).sum() + layer.aux_loss()).backward(); }));
    };
    const auto step_dense = [&] {
      dense.zero_grad();
      dist::barrier();
      return bench::max_over_ranks(bench::seconds([&] { dense(x).sum().backward(); }));
    };
    std::vector<double> grouped_s, loop_s, dense_s;
    for (int i = 0; i < repetitions + 1; ++i) {  // the first round warms up
      const double a = step_moe(*grouped), b = step_moe(*loop), d = step_dense();
      if (i > 0) grouped_s.push_back(a), loop_s.push_back(b), dense_s.push_back(d);
    }
    const double a = bench::median(grouped_s), b = bench::median(loop_s),
                 d = bench::median(dense_s);
    if (dist::rank() == 0) {
      char name[64];
      std::snprintf(name, sizeof name, "(%lld, %lld, %lld, %lld)",
                    static_cast<long long>(c.experts), static_cast<long long>(c.top_k),
                    static_cast<long long>(c.ffn), static_cast<long long>(c.shared_ffn));
      std::printf("%-34s %9.1f %9.1f %9.1f %11.2f %11.2f\n", name, 1e3 * a, 1e3 * b, 1e3 * d, a / d,
                  b / a);
      std::fflush(stdout);
    }
  }
  return 0;
}

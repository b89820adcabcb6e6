// One data-parallel training step of an MLP with about 10M parameters, under mpirun, with each
// way of averaging the gradients, all in the same run (cases interleaved, medians of
// repetitions; every rank times the same steps and rank 0 prints):
//   mpirun -np 2 bench_ddp [repetitions=9] [batch=32]
// One line per case: case= step_ms= ratio= (ratio = step / compute-only step), then the time of
// one flat all_reduce of every gradient and the share of it that DDP hid behind backward. The
// decentralized ring case steps with lr 0 inside backward and waits for its neighbour average
// at the next forward (inside the next timed step).
#include <weave/weave.h>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench_dist.h"
#include "bench_util.h"

using namespace weave;

namespace {

std::shared_ptr<nn::Sequential> make_model() {
  manual_seed(0);
  return std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(784, 2048), nn::ReLU(), std::make_shared<nn::Linear>(2048, 2048),
      nn::ReLU(), std::make_shared<nn::Linear>(2048, 1536), nn::ReLU(),
      std::make_shared<nn::Linear>(1536, 10)});
}

struct Timing {
  double wall = 0, cpu = 0;  // slowest rank's wall seconds, mean CPU seconds per rank
};

// Every rank's step must end at the same moment for the next to start together.
Timing timed(const std::function<void()>& step) {
  dist::barrier();
  double wall = 0;
  const double cpu = bench::cpu_seconds([&] { wall = bench::seconds(step); });
  const double slowest = bench::max_over_ranks(wall);
  Tensor mean_cpu = full({1}, cpu, {.dtype = kFloat64});
  dist::all_reduce(mean_cpu, dist::ReduceOp::Avg);
  return {slowest, mean_cpu.item<double>()};
}

}  // namespace

int main(int argc, char** argv) {
  set_num_threads(1);
  dist::InitGuard guard;
  const int reps = argc > 1 ? std::stoi(argv[1]) : 9;
  const int64_t batch = argc > 2 ? std::stoll(argv[2]) : 32;
  const double bucket_mb = argc > 3 ? std::stod(argv[3]) : parallel::DDPOptions{}.bucket_mb;
  const int me = dist::rank(), n = dist::world_size();
  Generator data(7 + uint64_t(me));
  Tensor x = randn({batch, 784}, {}, &data);
  Tensor y = randint(0, 10, {batch}, {.dtype = kInt64}, &data);

  struct Case {
    std::string name;
    std::shared_ptr<nn::Sequential> model;
    std::function<void()> step;
    std::vector<double> times, cpu_times;
  };
  std::vector<std::unique_ptr<Case>> cases;
  auto add = [&](std::string name, auto make_step) {
    auto c = std::make_unique<Case>();
    c->name = std::move(name);
    c->model = make_model();
    c->step = make_step(*c->model);
    cases.push_back(std::move(c));
  };
  auto backward = [&](nn::Module& model, auto&& forward) {
    model.zero_grad(false);
    cross_entropy(forward(x), y).backward();
  };

  add("compute_only", [&](nn::Sequential& m) {
    return [&, &m = m] { backward(m, [&](const Tensor& in) { return m(in); }); };
  });
  add("naive_per_parameter", [&](nn::Sequential& m) {
    return [&, &m = m] {
      backward(m, [&](const Tensor& in) { return m(in); });
      for (const Tensor& p : m.parameters()) dist::all_reduce(p.grad(), dist::ReduceOp::Avg);
    };
  });
  add("flat_after_backward", [&](nn::Sequential& m) {
    return [&, &m = m] {
      backward(m, [&](const Tensor& in) { return m(in); });
      parallel::average_gradients(m.parameters(), dist::world(), 1e6);  // one bucket
    };
  });
  std::vector<std::unique_ptr<optim::SGD>> sgds;
  std::vector<std::unique_ptr<parallel::DistributedOptimizer>> dist_opts;
  add("distributed_optimizer", [&](nn::Sequential& m) {
    sgds.push_back(std::make_unique<optim::SGD>(m.parameters(), optim::SGDOptions{.lr = 0.0}));
    dist_opts.push_back(std::make_unique<parallel::DistributedOptimizer>(*sgds.back()));
    auto* opt = dist_opts.back().get();
    return [&, &m = m, opt] {
      backward(m, [&](const Tensor& in) { return m(in); });
      opt->average_gradients();
    };
  });
  std::vector<std::unique_ptr<parallel::DistributedDataParallel>> ddps;
  for (bool bf16 : {false, true}) {
    add(bf16 ? "ddp_bf16" : "ddp", [&, bf16](nn::Sequential& m) {
      ddps.push_back(std::make_unique<parallel::DistributedDataParallel>(
          m, parallel::DDPOptions{
                 .bucket_mb = bucket_mb,
                 .compress = bf16 ? std::optional<DType>(kBFloat16) : std::optional<DType>()}));
      auto* ddp = ddps.back().get();
      return [&, &m = m, ddp] { backward(m, [&](const Tensor& in) { return (*ddp)(in); }); };
    });
  }
  std::vector<std::unique_ptr<parallel::DecentralizedDataParallel>> decentralized;
  if (n % 2 == 0)
    add("decentralized_ring", [&](nn::Sequential& m) {
      decentralized.push_back(std::make_unique<parallel::DecentralizedDataParallel>(
          m,
          [](std::vector<Tensor> bucket) {
            return std::make_unique<optim::SGD>(std::move(bucket), optim::SGDOptions{.lr = 0.0});
          },
          parallel::DecentralizedOptions{.topology = "ring"}));
      auto* dec = decentralized.back().get();
      return [&, &m = m, dec] { backward(m, [&](const Tensor& in) { return (*dec)(in); }); };
    });
  int64_t parameters = 0;
  for (const Tensor& p : cases[0]->model->parameters()) parameters += p.numel();
  Tensor flat = zeros({parameters});
  double flat_all_reduce = 0, flat_all_reduce_cpu = 0;
  {
    std::vector<double> wall, cpu;
    for (int r = 0; r < reps + 1; ++r) {
      const Timing t = timed([&] { dist::all_reduce(flat, dist::ReduceOp::Avg); });
      if (r > 0) wall.push_back(t.wall), cpu.push_back(t.cpu);
    }
    flat_all_reduce = bench::median(wall);
    flat_all_reduce_cpu = bench::median(cpu);
  }

  for (auto& c : cases) c->step();  // warm up (DDP traces its buckets here)
  for (int r = 0; r < reps; ++r)
    for (auto& c : cases) {
      const Timing t = timed(c->step);
      c->times.push_back(t.wall);
      c->cpu_times.push_back(t.cpu);
    }

  const double compute = bench::median(cases[0]->times);
  if (me == 0) {
    std::printf("ranks=%d parameters=%lld batch_per_rank=%lld repetitions=%d\n", n,
                static_cast<long long>(parameters), static_cast<long long>(batch), reps);
    for (auto& c : cases) {
      const double step = bench::median(c->times);
      std::printf("case=%s step_ms=%.2f ratio=%.3f cpu_ms=%.2f\n", c->name.c_str(), step * 1e3,
                  step / compute, bench::median(c->cpu_times) * 1e3);
    }
    const double ddp = bench::median(cases[4]->times);
    std::printf(
        "flat_all_reduce_ms=%.2f flat_all_reduce_cpu_ms=%.2f ddp_overhead_ms=%.2f "
        "hidden_share=%.2f ddp_within_half_all_reduce=%s\n",
        flat_all_reduce * 1e3, flat_all_reduce_cpu * 1e3, (ddp - compute) * 1e3,
        1.0 - (ddp - compute) / flat_all_reduce,
        ddp <= compute + 0.5 * flat_all_reduce ? "yes" : "no");
    for (auto& d : ddps)
      std::printf("ddp buckets=%d first_launch_after=%lld/%lld gradients\n", d->stats().buckets,
                  static_cast<long long>(d->stats().ready_before_first_launch),
                  static_cast<long long>(d->stats().parameters));
  }
  return 0;
}

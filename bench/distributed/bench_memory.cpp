// Per-rank memory and step time of one GPT training step (AdamW, float32) under each
// data-parallel strategy, with and without activation checkpointing, all in the same run
// (cases interleaved, medians of repetitions; rank 0 prints):
//   mpirun -np 2 bench_memory [repetitions=5] [layers=8] [dim=256] [context=128] [batch=4]
// batch is per rank, so every rank does the same work at any world size.
//
// Memory comes from memory_stats(kCPU), per case:
//   state     bytes the case keeps between steps (model, gradients, optimizer state, the
//             strategy's buffers): in_use after building it and two steps, minus before
//   peak      state + the highest in_use during a step above the in_use before it
//   transient peak - state: activations, gathered units, gradient temporaries
//   activations  transient - the transient of a one-token step (which holds the same gathered
//             units and gradient buffers but next to no activations)
//   construction  the highest in_use above the before while the model and its wrapper are built
//             (a model built under nn::DeferredInit: FSDP draws only each rank's shards)
// Each figure is the largest over the ranks. Step time is the slowest rank's wall time.
// The last lines check the targets (ZeRO-3 state, checkpointing's cut and cost, ZeRO-3's
// step time against DDP's).
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

struct Config {
  int64_t layers = 8, dim = 256, heads = 4, context = 128, batch = 4, vocab = 256;
};

// A GPT-2 style model: token and position embeddings, pre-norm blocks, a final norm and head.
class Gpt : public nn::Module {
 public:
  Gpt(const Config& c, bool checkpoint) : nn::Module("Gpt"), checkpoint_(checkpoint) {
    tokens = register_module("tokens", std::make_shared<nn::Embedding>(c.vocab, c.dim));
    positions = register_module("positions", std::make_shared<nn::Embedding>(c.context, c.dim));
    for (int64_t i = 0; i < c.layers; ++i)
      blocks.push_back(register_module("block" + std::to_string(i),
                                       std::make_shared<nn::TransformerBlock>(c.dim, c.heads)));
    norm = register_module("norm", std::make_shared<nn::LayerNorm>(Shape{c.dim}));
    head = register_module("head", std::make_shared<nn::Linear>(c.dim, c.vocab));
  }
  Tensor forward(const Tensor& ids) override {
    Tensor where = arange(0, double(ids.size(1)), 1, {.dtype = kInt64});
    Tensor x = (*tokens)(ids) + (*positions)(where);
    for (auto& block : blocks)
      x = checkpoint_ ? autograd::checkpoint([&b = *block](const Tensor& h) { return b(h); }, x)
                      : (*block)(x);
    return (*head)((*norm)(x));
  }
  std::shared_ptr<nn::Embedding> tokens, positions;
  std::vector<std::shared_ptr<nn::TransformerBlock>> blocks;
  std::shared_ptr<nn::LayerNorm> norm;
  std::shared_ptr<nn::Linear> head;

 private:
  bool checkpoint_;
};

struct Case {
  std::string name;
  bool checkpoint = false;
  std::shared_ptr<Gpt> model;
  std::function<void()> step;
  double state_bytes = 0, fixed_transient = 0, construction_bytes = 0;
  std::vector<double> times, transients;
  // Kept alive with the case: the wrappers and optimizers its step uses.
  std::shared_ptr<void> owner;
};

}  // namespace

int main(int argc, char** argv) {
  set_num_threads(1);
  dist::InitGuard guard;
  const int reps = argc > 1 ? std::stoi(argv[1]) : 5;
  Config c;
  if (argc > 2) c.layers = std::stoll(argv[2]);
  if (argc > 3) c.dim = std::stoll(argv[3]);
  if (argc > 4) c.context = std::stoll(argv[4]);
  if (argc > 5) c.batch = std::stoll(argv[5]);
  const int me = dist::rank(), n = dist::world_size();
  Generator data(7 + uint64_t(me));
  // The steps read `batch`: the benchmark's, or one token to measure what is not activations.
  struct Batch {
    Tensor ids, targets;
  };
  auto make_batch = [&](int64_t rows, int64_t length) {
    Tensor windows = randint(0, c.vocab, {rows, length + 1}, {.dtype = kInt64}, &data);
    return Batch{windows.narrow(1, 0, length).contiguous(),
                 windows.narrow(1, 1, length).reshape({-1})};
  };
  const Batch full_batch = make_batch(c.batch, c.context), one_token = make_batch(1, 1);
  Batch batch = full_batch;
  const Tensor& ids = batch.ids;
  auto loss_of = [&](const Tensor& logits) {
    return cross_entropy(logits.reshape({-1, c.vocab}), batch.targets);
  };
  const optim::AdamWOptions adamw{.lr = 1e-4};

  std::vector<std::unique_ptr<Case>> cases;
  // make(model) returns the step and whatever it must keep alive.
  using Made = std::pair<std::function<void()>, std::shared_ptr<void>>;
  auto add = [&](std::string name, bool checkpoint, const std::function<Made(Gpt&)>& make,
                 bool deferred = false) {
    auto k = std::make_unique<Case>();
    k->name = std::move(name) + (checkpoint ? "+ckpt" : "");
    k->checkpoint = checkpoint;
    dist::barrier();
    const double before = double(memory_stats().in_use);
    reset_peak_memory();
    manual_seed(0);
    if (deferred) {
      nn::DeferredInit scope(/*seed=*/0);
      k->model = std::make_shared<Gpt>(c, checkpoint);
    } else {
      k->model = std::make_shared<Gpt>(c, checkpoint);
    }
    std::tie(k->step, k->owner) = make(*k->model);
    k->construction_bytes = bench::max_over_ranks(double(memory_stats().peak) - before);
    for (int i = 0; i < 2; ++i) k->step();  // optimizer state and traced buckets exist now
    k->state_bytes = bench::max_over_ranks(double(memory_stats().in_use) - before);
    cases.push_back(std::move(k));
  };

  // An FSDP case: the wrapper with `options`, AdamW over its shards.
  auto fsdp_case = [&](parallel::FSDPOptions options) {
    return [&, options](Gpt& m) -> Made {
      auto fsdp = std::make_shared<parallel::FullyShardedDataParallel>(m, options);
      auto opt = std::make_shared<optim::AdamW>(fsdp->parameters(), adamw);
      return {[&, fsdp, opt] {
                opt->zero_grad(false);
                loss_of((*fsdp)(ids)).backward();
                opt->step();
              },
              std::make_shared<std::pair<decltype(fsdp), decltype(opt)>>(fsdp, opt)};
    };
  };
  for (bool checkpoint : {false, true}) {
    add("ddp", checkpoint, [&](Gpt& m) -> Made {
      auto ddp = std::make_shared<parallel::DistributedDataParallel>(m);
      auto opt = std::make_shared<optim::AdamW>(m.parameters(), adamw);
      return {[&, ddp, opt] {
                opt->zero_grad(false);
                loss_of((*ddp)(ids)).backward();
                opt->step();
              },
              std::make_shared<std::pair<decltype(ddp), decltype(opt)>>(ddp, opt)};
    });
    add("zero1", checkpoint, [&](Gpt& m) -> Made {
      auto zero = std::make_shared<parallel::ZeroRedundancyOptimizer>(
          m.parameters(), [&](std::vector<Tensor> shard) -> std::unique_ptr<optim::Optimizer> {
            return std::make_unique<optim::AdamW>(std::move(shard), adamw);
          });
      return {[&, zero, &m = m] {
                zero->zero_grad(false);
                loss_of(m(ids)).backward();
                zero->step();
              },
              zero};
    });
    for (auto sharding :
         {parallel::ShardingStrategy::ShardGradOp, parallel::ShardingStrategy::FullShard}) {
      const bool full = sharding == parallel::ShardingStrategy::FullShard;
      add(full ? "fsdp_zero3" : "fsdp_zero2", checkpoint, fsdp_case({.sharding = sharding}));
    }
  }

  // FSDP from a deferred model (construction 1/N), and under a bfloat16 policy (float32 shards).
  add("fsdp_zero3_deferred", false, fsdp_case({}), /*deferred=*/true);
  add("fsdp_zero3_bf16", false,
      fsdp_case({.param_dtype = kBFloat16, .reduce_dtype = kFloat32, .output_dtype = kFloat32}),
      /*deferred=*/true);

  // One step's wall time and its peak above the in_use before it (largest over the ranks).
  auto measure = [](Case& k) {
    dist::barrier();
    const double before = double(memory_stats().in_use);
    reset_peak_memory();
    const double wall = bench::seconds(k.step);
    return std::pair{bench::max_over_ranks(wall),
                     bench::max_over_ranks(double(memory_stats().peak) - before)};
  };
  for (int r = 0; r < reps; ++r)
    for (auto& k : cases) {
      const auto [wall, transient] = measure(*k);
      k->times.push_back(wall);
      k->transients.push_back(transient);
    }
  // What a step holds beyond its state whatever the batch (gathered units, gradient buffers in
  // flight, a layer's fresh weight gradient): the transient of a one-token step. The rest of the
  // transient is activation memory.
  batch = one_token;
  for (auto& k : cases) {
    k->step();
    k->fixed_transient = measure(*k).second;
  }
  batch = full_batch;

  int64_t parameters = 0, block_parameters = 0;
  for (const Tensor& p : cases[0]->model->parameters()) parameters += p.numel();
  for (const Tensor& p : cases[0]->model->blocks[0]->parameters()) block_parameters += p.numel();
  if (me != 0) return 0;
  const double mb = 1e6;
  std::printf(
      "ranks=%d layers=%lld dim=%lld context=%lld batch_per_rank=%lld parameters=%lld "
      "repetitions=%d\n",
      n, static_cast<long long>(c.layers), static_cast<long long>(c.dim),
      static_cast<long long>(c.context), static_cast<long long>(c.batch),
      static_cast<long long>(parameters), reps);
  auto find = [&](const std::string& name) -> Case& {
    for (auto& k : cases)
      if (k->name == name) return *k;
    throw std::logic_error("no case " + name);
  };
  const Case& ddp = find("ddp");
  const double ddp_step = bench::median(ddp.times);
  auto activations = [](const Case& k) { return bench::median(k.transients) - k.fixed_transient; };
  for (auto& k : cases) {
    const double transient = bench::median(k->transients), step = bench::median(k->times);
    std::printf(
        "case=%-20s construction_mb=%7.2f state_mb=%7.2f peak_mb=%7.2f transient_mb=%7.2f "
        "activations_mb=%7.2f step_ms=%8.1f step_vs_ddp=%.3f\n",
        k->name.c_str(), k->construction_bytes / mb, k->state_bytes / mb,
        (k->state_bytes + transient) / mb, transient / mb, activations(*k) / mb, step * 1e3,
        step / ddp_step);
  }
  // Targets. Two units: FSDP's units here are the model's children; the largest is a block.
  const double unit_bytes = 4.0 * double(block_parameters);
  const Case& zero3 = find("fsdp_zero3");
  const double zero3_bound = ddp.state_bytes / n + 2 * unit_bytes;
  std::printf("target zero3_state_mb=%.2f <= ddp_state/N + two units = %.2f: %s\n",
              zero3.state_bytes / mb, zero3_bound / mb,
              zero3.state_bytes <= zero3_bound ? "met" : "MISSED");
  for (std::string name : {"ddp", "zero1", "fsdp_zero2", "fsdp_zero3"}) {
    const Case& plain = find(name);
    const Case& ckpt = find(name + "+ckpt");
    const double cut = activations(ckpt) / activations(plain);
    const double cost = bench::median(ckpt.times) / bench::median(plain.times);
    std::printf("target %s checkpointing activations=%.2f (<= 0.30) time=%.3f (<= 1.40): %s\n",
                name.c_str(), cut, cost, cut <= 0.30 && cost <= 1.40 ? "met" : "MISSED");
  }
  const double zero3_ratio = bench::median(zero3.times) / ddp_step;
  std::printf("target zero3_step/ddp_step=%.3f (<= 1.30 at 2 ranks): %s\n", zero3_ratio,
              n != 2                ? "not a target at this world size"
              : zero3_ratio <= 1.30 ? "met"
                                    : "MISSED");
  return 0;
}

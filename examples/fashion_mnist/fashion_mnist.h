#pragma once
// The Fashion-MNIST MLP trainer behind fashion_mnist_mlp and fashion_mnist_ddp: flags, data,
// model, and a training loop whose gradient averaging is a data-parallel strategy.
//
//   [--epochs 10] [--batch-size 128] [--lr 0.001] [--seed 0] [--data DIR] [--threads N]
//   [--log FILE]   (a metrics record per epoch, JSON Lines: weave-plot FILE -o curves.png)
//   [--strategy ddp|dist-opt|zero1|fsdp|fsdp-zero2|decentralized:TOPOLOGY] [--compress bf16|fp16]
//   [--autocast bf16|fp16]   (forward under AutocastGuard; fp16 adds a GradScaler, agreed over
//                             the ranks; decentralized steps inside backward, without one)
//   [--recipe small]   (784-256-128-10 without dropout, Adam at a constant lr: the recipe
//                       bench/training/torch_ddp_fashion_mnist.py runs in PyTorch)
//   model-parallel examples: [--schedule gpipe|1f1b] [--microbatches M] [--tensor T]
//
// --batch-size is the global batch, split across the ranks; each rank draws its share of every
// epoch from a DistributedSampler. Rank 0 prints one line per epoch, then exactly
// `test_accuracy=0.XXXX`, then its peak tensor memory (memory_stats).
#include <weave/weave.h>

#include <weave/util/cli.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fashion_mnist {

using namespace weave;

struct Flags {
  int epochs = 10;
  int64_t batch_size = 128;
  double lr = 1e-3;
  uint64_t seed = 0;
  int threads = 0;
  std::string data = data::kFashionMnistDir;
  std::string strategy = "ddp";
  std::optional<DType> compress;
  std::optional<DType> autocast;
  bool small_recipe = false;
  parallel::Schedule schedule = parallel::Schedule::OneFOneB;
  int microbatches = 4;
  int tensor = 0;   // tensor-parallel group size (0: the example's default)
  std::string log;  // metrics file (JSON Lines), "" for none
};

inline Flags parse(int argc, char** argv, const char* program) {
  Flags f;
  CLI::App app("Fashion-MNIST MLP training (examples/fashion_mnist/fashion_mnist.h).", program);
  app.option_defaults()->always_capture_default();
  app.add_option("--epochs", f.epochs)->check(weave::cli::positive());
  app.add_option("--batch-size", f.batch_size, "global batch, split across the ranks")
      ->check(weave::cli::positive());
  app.add_option("--lr", f.lr)->check(weave::cli::positive());
  app.add_option("--seed", f.seed);
  app.add_option("--data", f.data, "directory of the IDX files");
  app.add_option("--log", f.log, "write a metrics record per epoch (JSON Lines, for weave-plot)");
  app.add_option("--threads", f.threads, "compute threads (0: the library's default)")
      ->check(weave::cli::non_negative());
  app.add_option("--strategy", f.strategy,
                 "ddp, dist-opt, zero1, fsdp, fsdp-zero2 or decentralized:TOPOLOGY")
      ->check(
          [](const std::string& s) -> std::string {
            const bool known = s == "ddp" || s == "dist-opt" || s == "zero1" || s == "fsdp" ||
                               s == "fsdp-zero2" || s.rfind("decentralized:", 0) == 0;
            return known ? ""
                         : fmt::format(
                               "expected ddp, dist-opt, zero1, fsdp, fsdp-zero2 or "
                               "decentralized:NAME (NAME: {})",
                               fmt::join(parallel::topology_names(), ", "));
          },
          "STRATEGY");
  std::string schedule, compress, autocast, recipe;
  app.add_option("--schedule", schedule, "pipeline schedule")
      ->check(CLI::IsMember({"gpipe", "1f1b"}));
  app.add_option("--microbatches", f.microbatches)->check(weave::cli::positive());
  app.add_option("--tensor", f.tensor, "tensor-parallel group size")
      ->check(weave::cli::non_negative());
  app.add_option("--recipe", recipe, "small: 784-256-128-10, Adam at a constant lr")
      ->check(CLI::IsMember({"small"}));
  app.add_option("--compress", compress, "gradient communication dtype")
      ->check(CLI::IsMember({"bf16", "fp16"}));
  app.add_option("--autocast", autocast, "reduced-precision forward")
      ->check(CLI::IsMember({"bf16", "fp16"}));
  weave::cli::parse_or_exit(app, argc, argv);
  if (!schedule.empty()) f.schedule = parallel::schedule_from_name(schedule);
  if (!compress.empty()) f.compress = compress == "bf16" ? kBFloat16 : kFloat16;
  if (!autocast.empty()) f.autocast = autocast == "bf16" ? kBFloat16 : kFloat16;
  f.small_recipe = recipe == "small";
  return f;
}

// Pixels to float, standardized with the training set's mean and deviation.
inline Tensor normalize(const Tensor& images) {
  // (x / 255 - mean) / std as one allocation and two in-place passes: the 188 MB training set
  // is touched fresh once, not four times (first touch is what loading costs on small VMs).
  Tensor x = images.to(kFloat32);
  x.mul_(1.0 / (255.0 * 0.3530)).add_(-0.2860 / 0.3530);
  return x;
}

inline double accuracy(nn::Module& model, const Tensor& images, const Tensor& labels) {
  NoGradGuard no_grad;
  model.eval();
  int64_t correct = 0;
  for (int64_t start = 0; start < images.size(0); start += 1000) {
    int64_t n = std::min<int64_t>(1000, images.size(0) - start);
    Tensor logits = model(images.narrow(0, start, n));
    correct += sum(eq(argmax(logits, 1), labels.narrow(0, start, n))).item<int64_t>();
  }
  model.train();
  return static_cast<double>(correct) / static_cast<double>(images.size(0));
}

// One compute thread per rank when ranks share the machine, unless --threads says otherwise.
inline void use_threads(const Flags& flags, int ranks) {
  if (flags.threads > 0)
    set_num_threads(flags.threads);
  else if (ranks > 1)
    set_num_threads(1);
}

struct Data {
  Tensor train_x, train_y, test_x, test_y;  // images flattened to [N, 784], normalized
};

inline Data load(const Flags& flags) {
  data::MnistSplit train = data::load_fashion_mnist(flags.data, true);
  data::MnistSplit test = data::load_fashion_mnist(flags.data, false);
  return {normalize(train.images).flatten(1), train.labels, normalize(test.images).flatten(1),
          test.labels};
}

// The default recipe's learning rate: linear warm-up, then cosine decay; constant for --recipe
// small.
inline optim::Schedule lr_schedule(const Flags& flags, int64_t total_steps) {
  if (flags.small_recipe) return [lr = flags.lr](int64_t) { return lr; };
  return optim::linear_warmup(optim::cosine_schedule(flags.lr, total_steps), 200);
}

// Rank 0's progress line (statistics summed over the ranks by the caller).
inline void report_epoch(int epoch, const Flags& flags, double loss, double train_acc,
                         double test_acc, double seconds, int ranks) {
  if (dist::rank() != 0) return;
  std::printf("epoch %d/%d loss=%.4f train_acc=%.4f test_acc=%.4f time=%.1fs ranks=%d\n", epoch,
              flags.epochs, loss, train_acc, test_acc, seconds, ranks);
  std::fflush(stdout);
}

// Trains with flags.strategy; returns the process's exit code.
inline int run(const Flags& flags) {
  dist::InitGuard distributed(dist::Backend::MPI);  // a world of one without mpirun
  const int rank = dist::rank(), ranks = dist::world_size();
  use_threads(flags, ranks);
  manual_seed(flags.seed + uint64_t(rank));  // DDP broadcasts rank 0's model

  const Data d = load(flags);
  const Tensor& test_x = d.test_x;
  auto dataset = std::make_shared<data::TensorDataset>(d.train_x, d.train_y);
  auto sampler = std::make_shared<parallel::DistributedSampler>(
      dataset->size(), parallel::DistributedSamplerOptions{.seed = flags.seed});
  const int64_t local_batch = std::max<int64_t>(1, flags.batch_size / ranks);
  data::DataLoader loader(dataset, {.batch_size = local_batch, .sampler = sampler});

  using Layers = std::vector<std::shared_ptr<nn::Module>>;
  const Layers layers = flags.small_recipe
                            ? Layers{std::make_shared<nn::Linear>(784, 256), nn::ReLU(),
                                     std::make_shared<nn::Linear>(256, 128), nn::ReLU(),
                                     std::make_shared<nn::Linear>(128, 10)}
                            : Layers{std::make_shared<nn::Linear>(784, 512),
                                     nn::ReLU(),
                                     std::make_shared<nn::Dropout>(0.2),
                                     std::make_shared<nn::Linear>(512, 256),
                                     nn::ReLU(),
                                     std::make_shared<nn::Dropout>(0.2),
                                     std::make_shared<nn::Linear>(256, 10)};
  nn::Sequential model;
  for (const auto& layer : layers) model.push_back(layer);
  // ddp: averaging overlaps backward; dist-opt: one fused averaging before each step; zero1:
  // reduce-scatter, step a 1/N slice of the Adam state, all-gather; fsdp: each layer's
  // parameters sharded too, gathered around its forward and backward (fsdp-zero2: gradients and
  // optimizer state sharded only); decentralized: local steps inside backward, then neighbour
  // averages over a topology.
  auto make_optimizer = [&](std::vector<Tensor> params) -> std::unique_ptr<optim::Optimizer> {
    if (flags.small_recipe)
      return std::make_unique<optim::Adam>(std::move(params), optim::AdamOptions{.lr = flags.lr});
    return std::make_unique<optim::AdamW>(
        std::move(params), optim::AdamWOptions{.lr = flags.lr, .weight_decay = 1e-4});
  };
  const optim::Schedule lr_at = lr_schedule(flags, flags.epochs * loader.size());
  std::unique_ptr<parallel::DistributedDataParallel> ddp;
  std::unique_ptr<parallel::DecentralizedDataParallel> decentralized;
  std::unique_ptr<parallel::DistributedOptimizer> averaging;
  std::unique_ptr<parallel::ZeroRedundancyOptimizer> zero;
  std::unique_ptr<parallel::FullyShardedDataParallel> fsdp;
  std::unique_ptr<optim::Optimizer> optimizer;
  if (flags.strategy == "ddp") {
    ddp = std::make_unique<parallel::DistributedDataParallel>(
        model, parallel::DDPOptions{.compress = flags.compress});
    optimizer = make_optimizer(model.parameters());
  } else if (flags.strategy == "dist-opt") {
    parallel::broadcast_parameters(model);
    optimizer = make_optimizer(model.parameters());
    averaging = std::make_unique<parallel::DistributedOptimizer>(
        *optimizer, parallel::DistributedOptimizerOptions{.compress = flags.compress});
  } else if (flags.strategy == "fsdp" || flags.strategy == "fsdp-zero2") {
    fsdp = std::make_unique<parallel::FullyShardedDataParallel>(
        model, parallel::FSDPOptions{.sharding = flags.strategy == "fsdp"
                                                     ? parallel::ShardingStrategy::FullShard
                                                     : parallel::ShardingStrategy::ShardGradOp});
    optimizer = make_optimizer(fsdp->parameters());  // this rank's shards
  } else if (flags.strategy == "zero1") {
    parallel::broadcast_parameters(model);
    zero = std::make_unique<parallel::ZeroRedundancyOptimizer>(model.parameters(), make_optimizer);
  } else {
    decentralized = std::make_unique<parallel::DecentralizedDataParallel>(
        model, make_optimizer,
        parallel::DecentralizedOptions{.topology = flags.strategy.substr(14),
                                       .lr_schedule = lr_at});
  }
  optim::Optimizer* stepped = zero ? &zero->shard_optimizer() : optimizer.get();
  // float16's range needs loss scaling; bfloat16 has float32's range and needs none
  parallel::GradScaler scaler({.enabled = flags.autocast == kFloat16 && !decentralized});
  int64_t step = 0;

  double test_accuracy = 0;
  // With --log: a record per epoch (its mean loss, the examples it took), and the test accuracy.
  data::MetricsLogger metrics({.path = flags.log,
                               .enabled = rank == 0 && !flags.log.empty(),
                               .total_steps = flags.epochs,
                               .progress = false});
  for (int epoch = 1; epoch <= flags.epochs; ++epoch) {
    auto start = std::chrono::steady_clock::now();
    sampler->set_epoch(epoch);
    double loss_sum = 0;
    int64_t correct = 0, seen = 0;
    for (const data::Example& batch : loader) {
      Tensor logits, loss;
      {
        std::optional<AutocastGuard> autocast;
        if (flags.autocast) autocast.emplace(*flags.autocast);
        logits = ddp             ? (*ddp)(batch.input)
                 : fsdp          ? (*fsdp)(batch.input)
                 : decentralized ? (*decentralized)(batch.input)
                                 : model(batch.input);
        loss = cross_entropy(logits, batch.target);  // float32 under autocast
      }
      if (stepped) {
        stepped->set_lr(lr_at(step));
        if (fsdp)
          optimizer->zero_grad(/*set_to_none=*/false);  // the shards' gradients
        else
          model.zero_grad(/*set_to_none=*/false);
      }
      // decentralized: each bucket steps and mixes inside backward
      scaler.scale(loss).backward();
      if (averaging)  // averages the gradients, then steps
        scaler.step(optimizer->params(), [&] { averaging->step(); });
      else if (zero)
        scaler.step(model.parameters(), [&] { zero->step(); });
      else if (optimizer)
        scaler.step(*optimizer);  // DDP averaged them during backward
      if (!decentralized) scaler.update();
      ++step;
      const int64_t n = batch.input.size(0);
      loss_sum += loss.item<double>() * static_cast<double>(n);
      correct += sum(eq(argmax(logits.detach(), 1), batch.target)).item<int64_t>();
      seen += n;
    }
    double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // Epoch statistics over all ranks' shares; the replicas are identical, so is their accuracy.
    Tensor stats = from_vector<double>({loss_sum, double(correct), double(seen)});
    dist::all_reduce(stats);
    auto totals = stats.to_vector<double>();
    if (decentralized && epoch == flags.epochs) decentralized->global_avg();  // one final model
    if (decentralized && epoch < flags.epochs) decentralized->wait();
    test_accuracy = accuracy(model, test_x, d.test_y);
    report_epoch(epoch, flags, totals[0] / totals[2], totals[1] / totals[2], test_accuracy, seconds,
                 ranks);
    metrics.log_step({.step = epoch,
                      .loss = totals[0] / totals[2],
                      .lr = lr_at(step - 1),
                      .tokens = int64_t(totals[2])});
    metrics.log_eval(epoch, "test_accuracy", test_accuracy);
  }
  if (rank == 0) {
    std::printf("test_accuracy=%.4f\n", test_accuracy);
    std::printf("peak tensor memory on rank 0: %.1f MB (memory_stats)\n",
                double(memory_stats().peak) / 1e6);
  }
  return 0;
}

}  // namespace fashion_mnist

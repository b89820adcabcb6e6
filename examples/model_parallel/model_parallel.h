#pragma once
// The Fashion-MNIST trainers behind the model-parallel examples (same flags, progress lines and
// closing `test_accuracy=0.XXXX` line as fashion_mnist_mlp; see fashion_mnist.h):
//   run_tensor_parallel: the MLP with its two big layers split over a tensor-parallel group,
//                        data parallel (DDP) across groups: a data x tensor mesh.
//   run_pipeline:        the MLP cut into one stage per rank, GPipe or 1F1B over micro-batches.
#include "fashion_mnist.h"

namespace fashion_mnist {

// 784 -> 512 -> 256 -> 10. Tensor parallel: the first layer splits its outputs (column), the
// second its inputs (row), so the pair communicates once (an all_reduce) forward and once
// backward; the small head and the dropout after the pair are replicated.
inline std::shared_ptr<nn::Sequential> tensor_parallel_mlp(const dist::Group& tp) {
  return std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<parallel::ColumnParallelLinear>(784, 512, tp), nn::ReLU(),
      std::make_shared<parallel::RowParallelLinear>(512, 256, tp), nn::ReLU(),
      std::make_shared<nn::Dropout>(0.2), std::make_shared<nn::Linear>(256, 10)});
}

inline std::unique_ptr<optim::Optimizer> adamw(const Flags& flags, std::vector<Tensor> params) {
  return std::make_unique<optim::AdamW>(std::move(params),
                                        optim::AdamWOptions{.lr = flags.lr, .weight_decay = 1e-4});
}

// tensor: the tensor-parallel group size, 0 for the whole world (the rest of the world is data
// parallel).
inline int run_tensor_parallel(const Flags& flags, int tensor) {
  dist::InitGuard distributed(dist::Backend::MPI);
  const int ranks = dist::world_size();
  if (tensor == 0) tensor = ranks;
  use_threads(flags, ranks);
  WEAVE_CHECK(tensor >= 1 && ranks % tensor == 0, "tensor_parallel",
              "--tensor {} does not divide the {} ranks", tensor, ranks);
  parallel::ProcessMesh mesh({.data = ranks / tensor, .tensor = tensor});
  // the ranks of a tensor group build the same (split) model and see the same batches
  manual_seed(flags.seed + uint64_t(mesh.data_rank()));
  auto model = tensor_parallel_mlp(mesh.tensor());
  parallel::DistributedDataParallel ddp(*model, {.group = mesh.data()});  // rank 0's weights
  auto optimizer = adamw(flags, model->parameters());

  const Data d = load(flags);
  auto dataset = std::make_shared<data::TensorDataset>(d.train_x, d.train_y);
  auto sampler = std::make_shared<parallel::DistributedSampler>(
      dataset->size(), parallel::DistributedSamplerOptions{.seed = flags.seed}, mesh.data());
  const int64_t local_batch = std::max<int64_t>(1, flags.batch_size / mesh.shape().data);
  data::DataLoader loader(dataset, {.batch_size = local_batch, .sampler = sampler});
  const optim::Schedule lr_at = lr_schedule(flags, flags.epochs * loader.size());
  if (dist::rank() == 0) std::printf("%s\n", mesh.str().c_str());

  int64_t step = 0;
  double test_accuracy = 0;
  for (int epoch = 1; epoch <= flags.epochs; ++epoch) {
    auto start = std::chrono::steady_clock::now();
    sampler->set_epoch(epoch);
    double loss_sum = 0, correct = 0, seen = 0;
    for (const data::Example& batch : loader) {
      Tensor logits = ddp(batch.input);
      Tensor loss = cross_entropy(logits, batch.target);
      optimizer->set_lr(lr_at(step++));
      model->zero_grad(/*set_to_none=*/false);
      loss.backward();
      optimizer->step();
      const double n = double(batch.input.size(0));
      loss_sum += loss.item<double>() * n;
      correct += double(sum(eq(argmax(logits.detach(), 1), batch.target)).item<int64_t>());
      seen += n;
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    Tensor stats = from_vector<double>({loss_sum, correct, seen});
    dist::all_reduce(stats, dist::ReduceOp::Sum, mesh.data());  // tensor ranks repeat their group's
    auto totals = stats.to_vector<double>();
    test_accuracy = accuracy(*model, d.test_x, d.test_y);
    report_epoch(epoch, flags, totals[0] / totals[2], totals[1] / totals[2], test_accuracy, seconds,
                 ranks);
  }
  if (dist::rank() == 0) std::printf("test_accuracy=%.4f\n", test_accuracy);
  return 0;
}

inline int run_pipeline(const Flags& flags) {
  dist::InitGuard distributed(dist::Backend::MPI);
  const int ranks = dist::world_size(), rank = dist::rank();
  use_threads(flags, ranks);
  manual_seed(flags.seed);  // every rank builds the whole model, then keeps its stage
  auto model = std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(784, 512), nn::ReLU(), std::make_shared<nn::Dropout>(0.2),
      std::make_shared<nn::Linear>(512, 256), nn::ReLU(), std::make_shared<nn::Dropout>(0.2),
      std::make_shared<nn::Linear>(256, 10)});
  auto stage = parallel::pipeline_stage(*model, rank, ranks);
  model.reset();  // the other stages' layers are freed
  parallel::Pipeline pipe(*stage, {.schedule = flags.schedule, .microbatches = flags.microbatches});
  auto optimizer = adamw(flags, stage->parameters());

  // every stage iterates the same batches: the first reads the images, the last the labels
  const Data d = load(flags);
  auto dataset = std::make_shared<data::TensorDataset>(d.train_x, d.train_y);
  data::DataLoader loader(
      dataset,
      {.batch_size = flags.batch_size, .shuffle = true, .drop_last = true, .seed = flags.seed});
  const optim::Schedule lr_at = lr_schedule(flags, flags.epochs * loader.size());
  if (rank == 0)
    std::printf("pipeline: %d stages, %s, %d micro-batches\n", ranks,
                flags.schedule == parallel::Schedule::GPipe ? "gpipe" : "1f1b", flags.microbatches);
  auto loss_fn = [](const Tensor& logits, const Tensor& target) {
    return cross_entropy(logits, target);
  };
  const int last = ranks - 1;

  int64_t step = 0;
  double test_accuracy = 0;
  for (int epoch = 1; epoch <= flags.epochs; ++epoch) {
    auto start = std::chrono::steady_clock::now();
    double loss_sum = 0, seen = 0, idle = 0;
    for (const data::Example& batch : loader) {
      optimizer->set_lr(lr_at(step++));
      stage->zero_grad(/*set_to_none=*/false);
      Tensor loss = pipe.train_step(batch.input, batch.target, loss_fn);
      optimizer->step();
      if (pipe.is_last()) loss_sum += loss.item<double>() * double(batch.input.size(0));
      seen += double(batch.input.size(0));
      idle += pipe.stats().idle_fraction();
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    stage->eval();
    Tensor logits = pipe.predict(d.test_x);
    stage->train();
    Tensor stats = zeros({2}, {.dtype = kFloat64});
    if (pipe.is_last())
      stats = from_vector<double>(
          {loss_sum / seen, double(sum(eq(argmax(logits, 1), d.test_y)).item<int64_t>()) /
                                double(d.test_y.size(0))});
    dist::broadcast(stats, last);
    auto values = stats.to_vector<double>();
    test_accuracy = values[1];
    if (rank == 0) {
      std::printf("epoch %d/%d loss=%.4f test_acc=%.4f time=%.1fs idle=%.2f ranks=%d\n", epoch,
                  flags.epochs, values[0], test_accuracy, seconds, idle / double(loader.size()),
                  ranks);
      std::fflush(stdout);
    }
  }
  if (rank == 0) std::printf("test_accuracy=%.4f\n", test_accuracy);
  return 0;
}

}  // namespace fashion_mnist

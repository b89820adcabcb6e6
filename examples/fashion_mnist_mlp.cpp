// Trains an MLP on Fashion-MNIST, in one process or data-parallel under mpirun:
//   fashion_mnist_mlp [--epochs 10] [--batch-size 128] [--lr 0.001] [--seed 0] [--data DIR]
//                     [--threads N]
//   mpirun -np 2 fashion_mnist_mlp ...      # each rank trains on its shard of the data
// --batch-size is the global batch (split across ranks); gradients are averaged across ranks
// after every backward. Rank 0 prints one line per epoch and, last, exactly
// `test_accuracy=0.XXXX`.
#include <chrono>
#include <cstdio>
#include <string>

#include <weave/weave.h>

using namespace weave;

namespace {

struct Flags {
  int epochs = 10;
  int64_t batch_size = 128;
  double lr = 1e-3;
  uint64_t seed = 0;
  int threads = 0;
  std::string data = data::kFashionMnistDir;
};

Flags parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> std::string {
      WEAVE_CHECK(i + 1 < argc, "fashion_mnist_mlp", "{} needs a value", arg);
      return argv[++i];
    };
    if (arg == "--epochs")
      f.epochs = std::stoi(value());
    else if (arg == "--batch-size")
      f.batch_size = std::stoll(value());
    else if (arg == "--lr")
      f.lr = std::stod(value());
    else if (arg == "--seed")
      f.seed = std::stoull(value());
    else if (arg == "--data")
      f.data = value();
    else if (arg == "--threads")
      f.threads = std::stoi(value());
    else
      WEAVE_FAIL(
          "fashion_mnist_mlp",
          "unknown flag '{}'; expected --epochs, --batch-size, --lr, --seed, --data, --threads",
          arg);
  }
  return f;
}

// Pixels to float, standardized with the training set's mean and deviation.
Tensor normalize(const Tensor& images) {
  return (images.to(kFloat32) / 255.0 - 0.2860) / 0.3530;
}

double accuracy(nn::Module& model, const Tensor& images, const Tensor& labels) {
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

}  // namespace

// Averages every parameter's gradient across ranks with one all_reduce over a flat buffer.
void average_gradients(const std::vector<Tensor>& params) {
  std::vector<Tensor> grads;
  for (const Tensor& p : params) grads.push_back(p.grad().reshape({-1}));
  Tensor flat = cat(grads);
  dist::all_reduce(flat, dist::ReduceOp::Avg);
  int64_t offset = 0;
  for (const Tensor& p : params) {
    p.grad().copy_(flat.narrow(0, offset, p.numel()).reshape(p.shape()));
    offset += p.numel();
  }
}

int main(int argc, char** argv) try {
  Flags flags = parse(argc, argv);
  dist::InitGuard distributed(dist::Backend::MPI);  // a world of one without mpirun
  const int rank = dist::rank(), ranks = dist::world_size();
  if (flags.threads > 0)
    set_num_threads(flags.threads);
  else if (ranks > 1)
    set_num_threads(1);     // ranks share this machine's cores
  manual_seed(flags.seed);  // the same initial model on every rank

  data::MnistSplit train = data::load_fashion_mnist(flags.data, true);
  data::MnistSplit test = data::load_fashion_mnist(flags.data, false);
  Tensor train_x = normalize(train.images).flatten(1), test_x = normalize(test.images).flatten(1);
  // Rank r trains on examples r, r + ranks, ...
  Tensor shard = arange(rank, double(train_x.size(0)), ranks, {.dtype = kInt64});
  auto dataset = std::make_shared<data::TensorDataset>(index_select(train_x, 0, shard),
                                                       index_select(train.labels, 0, shard));
  const int64_t local_batch = std::max<int64_t>(1, flags.batch_size / ranks);
  data::DataLoader loader(
      dataset, {.batch_size = local_batch, .shuffle = true, .seed = flags.seed + uint64_t(rank)});

  nn::Sequential model{
      std::make_shared<nn::Linear>(784, 512), nn::ReLU(), std::make_shared<nn::Dropout>(0.2),
      std::make_shared<nn::Linear>(512, 256), nn::ReLU(), std::make_shared<nn::Dropout>(0.2),
      std::make_shared<nn::Linear>(256, 10)};
  optim::AdamW optimizer(model.parameters(), {.lr = flags.lr, .weight_decay = 1e-4});
  const int64_t total_steps = flags.epochs * loader.size();
  optim::LRScheduler scheduler(
      optimizer, optim::linear_warmup(optim::cosine_schedule(flags.lr, total_steps), 200));

  double test_accuracy = 0;
  for (int epoch = 1; epoch <= flags.epochs; ++epoch) {
    auto start = std::chrono::steady_clock::now();
    double loss_sum = 0;
    int64_t correct = 0, seen = 0;
    for (const data::Example& batch : loader) {
      Tensor logits = model(batch.input);
      Tensor loss = cross_entropy(logits, batch.target);
      optimizer.zero_grad();
      loss.backward();
      if (ranks > 1) average_gradients(optimizer.params());
      optimizer.step();
      scheduler.step();
      const int64_t n = batch.input.size(0);
      loss_sum += loss.item<double>() * static_cast<double>(n);
      correct += sum(eq(argmax(logits.detach(), 1), batch.target)).item<int64_t>();
      seen += n;
    }
    double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // Epoch statistics over all ranks' shards; the replicas are identical, so is their accuracy.
    Tensor stats = from_vector<double>({loss_sum, double(correct), double(seen)});
    dist::all_reduce(stats);
    auto totals = stats.to_vector<double>();
    test_accuracy = accuracy(model, test_x, test.labels);
    if (rank == 0) {
      std::printf("epoch %d/%d loss=%.4f train_acc=%.4f test_acc=%.4f time=%.1fs ranks=%d\n", epoch,
                  flags.epochs, totals[0] / totals[2], totals[1] / totals[2], test_accuracy,
                  seconds, ranks);
      std::fflush(stdout);
    }
  }
  if (rank == 0) std::printf("test_accuracy=%.4f\n", test_accuracy);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}

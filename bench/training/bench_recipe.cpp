// The standard small recipe, the one PyTorch runs in bench/training/torch_recipe.py: MLP
// 784-256-128-10 (ReLU), Adam 1e-3, cross-entropy, Fashion-MNIST scaled to [0, 1], one thread.
//   bench_recipe [epochs=10] [steps=200]
// Prints:
//   step batch=B step_us=...  limit_us=... (gemm_us=... optimizer_us=...) ratio_to_limit=...
//     for B = 64 and 1024: the median training step on fixed data, and the limit: the step's
//     eight GEMMs run alone through weave's GEMM (OpenBLAS when built with it, the fastest
//     library here for these shapes: see README, bench/kernels/compare_gemm.sh) plus one
//     pass of Adam's bytes (read p, g, m, v; write p, m, v) at this machine's memcpy bandwidth
//   epochs=E wall_s=... best_test_accuracy=...   shuffled batches of 64 sliced from the tensors
//   (epochs=0 skips the run)
#include <weave/weave.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "weave/kernels/kernels.h"

using namespace weave;

namespace {

std::shared_ptr<nn::Sequential> make_model() {
  manual_seed(0);
  return std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(784, 256), nn::ReLU(), std::make_shared<nn::Linear>(256, 128),
      nn::ReLU(), std::make_shared<nn::Linear>(128, 10)});
}

double median_of(int runs, const std::function<void()>& fn) {
  std::vector<double> t;
  for (int i = 0; i < runs; ++i) t.push_back(bench::seconds(fn));
  return bench::median(t);
}

// Seconds of the step's GEMMs alone: forward x W1^T, h1 W2^T, h2 W3^T; backward the three
// weight gradients and the two input gradients that are needed (not the data's).
double gemm_seconds(int64_t b, int runs) {
  const int64_t sizes[4] = {784, 256, 128, 10};
  std::vector<std::function<void()>> gemms;
  std::vector<Tensor> keep;
  for (int l = 0; l < 3; ++l) {
    const int64_t in = sizes[l], out = sizes[l + 1];
    Tensor x = randn({b, in}), w = randn({out, in}), dz = randn({b, out});
    Tensor y = empty({b, out}), dw = empty({out, in}), dx = empty({b, in});
    keep.insert(keep.end(), {x, w, dz, y, dw, dx});
    gemms.push_back([=] { kernels::matmul(x.unsqueeze(0), w.t().unsqueeze(0), y.unsqueeze(0)); });
    gemms.push_back([=] { kernels::matmul(dz.t().unsqueeze(0), x.unsqueeze(0), dw.unsqueeze(0)); });
    if (l > 0)
      gemms.push_back([=] { kernels::matmul(dz.unsqueeze(0), w.unsqueeze(0), dx.unsqueeze(0)); });
  }
  for (auto& g : gemms) g();
  return median_of(runs, [&] {
    for (auto& g : gemms) g();
  });
}

// Bytes per second of a large memcpy (the bandwidth an elementwise pass can reach).
double memcpy_bandwidth() {
  const size_t bytes = size_t{64} << 20;
  std::vector<char> a(bytes, 1), b(bytes, 2);
  const double s = median_of(9, [&] { std::memcpy(b.data(), a.data(), bytes); });
  return 2.0 * double(bytes) / s;  // read + write
}

void step_line(int64_t batch, int steps, const Tensor& train_x, const Tensor& train_y,
               double bandwidth) {
  auto model = make_model();
  optim::Adam opt(model->parameters(), {.lr = 1e-3});
  Tensor x = train_x.narrow(0, 0, batch).contiguous(), y = train_y.narrow(0, 0, batch).contiguous();
  auto step = [&] {
    opt.zero_grad(false);
    cross_entropy((*model)(x), y).backward();
    opt.step();
  };
  for (int i = 0; i < 10; ++i) step();
  const double step_s = median_of(steps, step);
  int64_t params = 0;
  for (const Tensor& p : model->parameters()) params += p.numel();
  const double gemm_s = gemm_seconds(batch, steps);
  const double optimizer_s = 7.0 * 4.0 * double(params) / bandwidth;
  const double limit = gemm_s + optimizer_s;
  std::printf(
      "weave step batch=%lld step_us=%.1f limit_us=%.1f (gemm_us=%.1f optimizer_us=%.1f) "
      "ratio_to_limit=%.2f\n",
      static_cast<long long>(batch), step_s * 1e6, limit * 1e6, gemm_s * 1e6, optimizer_s * 1e6,
      step_s / limit);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const int epochs = argc > 1 ? std::stoi(argv[1]) : 10;
  const int steps = argc > 2 ? std::stoi(argv[2]) : 200;
  set_num_threads(1);
  const auto start = std::chrono::steady_clock::now();
  data::MnistSplit train = data::load_fashion_mnist(data::kFashionMnistDir, true);
  data::MnistSplit test = data::load_fashion_mnist(data::kFashionMnistDir, false);
  const Tensor train_x = (train.images.to(kFloat32) / 255.0).flatten(1);
  const Tensor test_x = (test.images.to(kFloat32) / 255.0).flatten(1);
  const double bandwidth = memcpy_bandwidth();
  std::printf("memcpy_GBps=%.1f\n", bandwidth / 1e9);
  for (int64_t batch : {int64_t{64}, int64_t{1024}})
    step_line(batch, steps, train_x, train.labels, bandwidth);
  if (epochs == 0) return 0;

  auto model = make_model();
  optim::Adam opt(model->parameters(), {.lr = 1e-3});
  std::mt19937_64 shuffle(0);
  const int64_t n = train_x.size(0);
  std::vector<int64_t> permutation(static_cast<size_t>(n));
  double best = 0;
  const auto run_start = std::chrono::steady_clock::now();
  for (int epoch = 0; epoch < epochs; ++epoch) {
    std::iota(permutation.begin(), permutation.end(), int64_t{0});
    std::shuffle(permutation.begin(), permutation.end(), shuffle);
    const Tensor order = from_vector(permutation);
    for (int64_t i = 0; i < n; i += 64) {
      Tensor index = order.narrow(0, i, std::min<int64_t>(64, n - i));
      opt.zero_grad(false);
      cross_entropy((*model)(index_select(train_x, 0, index)), index_select(train.labels, 0, index))
          .backward();
      opt.step();
    }
    NoGradGuard no_grad;
    const double accuracy =
        double(sum(eq(argmax((*model)(test_x), 1), test.labels)).item<int64_t>()) /
        double(test_x.size(0));
    best = std::max(best, accuracy);
  }
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
  std::printf("weave epochs=%d wall_s=%.2f best_test_accuracy=%.4f (with loading %.2f s)\n", epochs,
              wall, best,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return 0;
}

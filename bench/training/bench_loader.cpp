// A data loader whose batches take a slow decode (about as long as the training step) hidden
// behind the step by worker threads: the time per epoch with 0 workers (decode, then step) and
// with 1 worker and prefetch 2 (decode of the next batches while the step runs), medians of
// alternating runs. On a machine with a spare core the threaded epoch approaches the longer of
// the two, not their sum.
//   bench_loader [batches = 24] [trials = 5]
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "bench_util.h"
#include "weave/weave.h"

using namespace weave;

namespace {

// Each batch is "decoded" by a CPU-bound loop (a stand-in for JPEG or text decoding).
class SlowDataset : public data::Dataset {
 public:
  int64_t size() const override { return 1 << 12; }
  data::Example get(int64_t index) const override {
    return {full({64}, double(index)), full({1}, double(index % 10))};
  }
  data::Example get_batch(const std::vector<int64_t>& indices) const override {
    double acc = 0;
    for (int64_t i = 0; i < 800'000; ++i) acc += std::sin(double(i + indices.front()));
    data::Example e = Dataset::get_batch(indices);
    e.input.add_(acc * 0.0);  // keeps the decode from being optimized away
    return e;
  }
};

}  // namespace

int main(int argc, char** argv) {
  const int batches = argc > 1 ? std::atoi(argv[1]) : 24;
  const int trials = argc > 2 ? std::atoi(argv[2]) : 5;
  set_num_threads(1);
  auto dataset = std::make_shared<SlowDataset>();
  Tensor activations = randn({256, 512}), v = randn({512, 512});
  auto step = [&](const data::Example& batch) {  // about one decode's time of matmuls
    Tensor h = activations + sum(batch.input).item() * 0.0;
    for (int i = 0; i < 6; ++i) h = matmul(h, v) * 0.01;
    return sum(h).item();
  };
  auto epoch = [&](int workers) {
    data::DataLoader loader(dataset, {.batch_size = 8, .num_workers = workers, .prefetch = 2});
    int n = 0;
    double total = 0;
    for (const data::Example& batch : loader) {
      total += step(batch);
      if (++n == batches) break;
    }
    return total;
  };
  const double decode = bench::median({bench::seconds([&] {
                          for (int i = 0; i < batches; ++i) dataset->get_batch({i});
                        })}) /
                        batches;
  data::Example one = dataset->get_batch({0, 1, 2, 3, 4, 5, 6, 7});
  const double compute = bench::median({bench::seconds([&] {
                           for (int i = 0; i < batches; ++i) step(one);
                         })}) /
                         batches;
  const auto [plain, threaded] = bench::alternate([&] { epoch(0); }, [&] { epoch(1); }, trials);
  std::printf("decode %.2f ms/batch, step %.2f ms/batch, %d batches\n", decode * 1e3, compute * 1e3,
              batches);
  std::printf("num_workers 0: %.1f ms/epoch\n", plain * 1e3);
  std::printf(
      "num_workers 1, prefetch 2: %.1f ms/epoch (%.2fx faster; the sum of decode and "
      "step would be %.1f ms, the longer of them %.1f ms)\n",
      threaded * 1e3, plain / threaded, (decode + compute) * batches * 1e3,
      std::max(decode, compute) * batches * 1e3);
}

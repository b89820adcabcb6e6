// Reproducible mode: DDP over the world, each rank running its share of 12 micro-batches (in
// order, or reversed), ends a step with the same gradient bits, the same clipped norm and the
// same loss as one process running all 12 (a DDP over a group of this rank alone); close to the
// float64 mean; and what would break it raises on every rank.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "helpers.h"
#include "weave/weave.h"

using namespace weave;
using parallel::DistributedDataParallel;

namespace {

constexpr int kMicrobatches = 12;
constexpr int64_t kRows = 3;
constexpr int kSteps = 2;

std::shared_ptr<nn::Sequential> make_model(DType dtype = kFloat32) {
  manual_seed(7);
  auto model = std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(5, 16), nn::Tanh(), std::make_shared<nn::Linear>(16, 8),
      nn::Tanh(), std::make_shared<nn::Linear>(8, 3)});
  model->to(dtype);
  return model;
}

// Micro-batch m of step s, the same at every layout; its targets span magnitudes so that the
// gradients' terms do.
std::pair<Tensor, Tensor> microbatch(int step, int m, DType dtype = kFloat32,
                                     int64_t rows = kRows) {
  Generator g(uint64_t(1000 * step + m));
  Tensor x = randn({rows, 5}, {.dtype = dtype}, &g);
  Tensor y = randn({rows, 3}, {.dtype = dtype}, &g) * std::ldexp(1.0, 9 * (m % 7) - 27);
  return {x, y};
}

struct StepResult {
  std::vector<std::vector<float>> grads;  // after clipping
  double norm = 0, loss = 0;
};

// kSteps steps of the micro-batches `mine` (global indices, run in this order) through a
// reproducible DDP over `group`, SGD between them; the last step's gradients, norm and loss.
StepResult run(const dist::Group& group, const std::vector<int>& mine) {
  auto model = make_model();
  DistributedDataParallel ddp(*model, {.group = group, .reproducible = true});
  optim::SGD sgd(model->parameters(), {.lr = 0.1});
  StepResult result;
  for (int step = 0; step < kSteps; ++step) {
    sgd.zero_grad();
    double losses = 0;
    for (size_t i = 0; i < mine.size(); ++i) {
      auto [x, y] = microbatch(step, mine[i]);
      auto backward = [&] {
        Tensor loss = mse_loss(ddp(x), y);
        losses += loss.item<double>();
        loss.backward();
      };
      if (i + 1 == mine.size()) {
        backward();
      } else {
        const parallel::NoSyncGuard accumulate = ddp.no_sync();
        backward();
      }
    }
    result.loss = dist::exact_sum(losses, group) / kMicrobatches;
    result.norm = parallel::clip_grad_norm_(model->parameters(), 0.5, 2.0, group);
    if (step + 1 < kSteps) sgd.step();
  }
  for (const Tensor& p : model->parameters()) result.grads.push_back(p.grad().to_vector<float>());
  return result;
}

bool same_bits(const StepResult& a, const StepResult& b) {
  if (a.grads.size() != b.grads.size()) return false;
  for (size_t i = 0; i < a.grads.size(); ++i)
    if (a.grads[i].size() != b.grads[i].size() ||
        std::memcmp(a.grads[i].data(), b.grads[i].data(), a.grads[i].size() * sizeof(float)) != 0)
      return false;
  return std::memcmp(&a.norm, &b.norm, sizeof(double)) == 0 &&
         std::memcmp(&a.loss, &b.loss, sizeof(double)) == 0;
}

dist::Group alone() {
  std::vector<std::vector<int>> singles;
  for (int r = 0; r < dist::world_size(); ++r) singles.push_back({r});
  return dist::split_group(dist::world(), singles);
}

std::vector<int> my_microbatches() {
  const parallel::MicroBatchPlan plan(kMicrobatches * kRows, kRows, dist::world_size(),
                                      dist::rank());
  std::vector<int> mine;
  for (int64_t i = 0; i < plan.local(); ++i) mine.push_back(int(plan.global(i)));
  return mine;
}

}  // namespace

TEST_SUITE("reproducible") {
  TEST_CASE("a reproducible step has one process's bits at any number of ranks, in any order") {
    std::vector<int> all(kMicrobatches);
    for (int m = 0; m < kMicrobatches; ++m) all[size_t(m)] = m;
    const StepResult one = run(alone(), all);
    std::vector<int> mine = my_microbatches();
    CHECK(same_bits(run(dist::world(), mine), one));
    // Each rank's micro-batches in reverse order (the sums do not mind), and one process's too.
    std::reverse(mine.begin(), mine.end());
    CHECK(same_bits(run(dist::world(), mine), one));
    std::reverse(all.begin(), all.end());
    CHECK(same_bits(run(alone(), all), one));
    // Close to the float64 mean of the micro-batches' gradients (clipped alike).
    auto model = make_model(kFloat64);
    optim::SGD sgd(model->parameters(), {.lr = 0.1});
    for (int step = 0; step < kSteps; ++step) {
      sgd.zero_grad();
      for (int m = 0; m < kMicrobatches; ++m) {
        auto [x, y] = microbatch(step, m, kFloat64);
        (mse_loss((*model)(x), y) / double(kMicrobatches)).backward();
      }
      const double norm = optim::clip_grad_norm_(model->parameters(), 0.5);
      if (step + 1 < kSteps) sgd.step();
      if (step + 1 == kSteps) CHECK(one.norm == doctest::Approx(norm).epsilon(1e-5));
    }
    const auto params = model->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      const Tensor expected = params[i].grad().to(kFloat32);
      const Tensor got = from_vector(one.grads[i], expected.shape());
      CHECK(test::close(got, expected, 1e-4, 1e-6));
    }
  }

  TEST_CASE("exact sums over the ranks equal one process adding every rank's terms") {
    std::vector<double> terms;
    for (int r = 0; r < dist::world_size(); ++r)
      terms.push_back(std::ldexp(1.0 + r / 3.0, 50 * (r % 2)) * (r % 3 == 1 ? -1 : 1));
    dist::ExactSum local;
    for (double t : terms) local.add(t);
    const double summed = dist::exact_sum(terms[size_t(dist::rank())]);
    CHECK(summed == local.value());
  }

  TEST_CASE("reproducible mode refuses what would break it, on every rank") {
    // Micro-batches of another size on the last rank.
    {
      auto model = make_model();
      DistributedDataParallel ddp(*model, {.reproducible = true});
      const bool odd = dist::rank() == dist::world_size() - 1;
      auto [x, y] = microbatch(0, 0, kFloat32, odd ? kRows + 1 : kRows);
      if (dist::world_size() == 1) {  // one rank: a second micro-batch of another size
        const parallel::NoSyncGuard accumulate = ddp.no_sync();
        mse_loss(ddp(x), y).backward();
        std::tie(x, y) = microbatch(0, 1, kFloat32, kRows);
      }
      const std::string error = test::error_of([&] { mse_loss(ddp(x), y).backward(); });
      CHECK(error.find("micro-batches") != std::string::npos);
    }
    // Compressed gradients.
    {
      auto model = make_model();
      const std::string error = test::error_of([&] {
        DistributedDataParallel ddp(*model, {.compress = kBFloat16, .reproducible = true});
      });
      CHECK(error.find("compress") != std::string::npos);
    }
    if (dist::world_size() == 1) return;
    // A tensor-parallel slice.
    {
      nn::Sequential model({std::make_shared<parallel::ColumnParallelLinear>(
          4, 4 * dist::world_size(), dist::world())});
      const std::string error = test::error_of(
          [&] { DistributedDataParallel ddp(model, {.group = alone(), .reproducible = true}); });
      CHECK(error.find("cut across ranks") != std::string::npos);
    }
    // Another thread count on rank 0.
    {
      auto model = make_model();
      const int threads = num_threads();
      if (dist::rank() == 0) set_num_threads(threads + 1);
      const std::string error =
          test::error_of([&] { DistributedDataParallel ddp(*model, {.reproducible = true}); });
      set_num_threads(threads);
      CHECK(error.find("thread count") != std::string::npos);
    }
  }
}

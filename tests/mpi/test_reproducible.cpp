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
  std::vector<std::vector<float>> values;  // the whole model's parameters after the steps
  double norm = 0, loss = 0;               // the last step's, before clipping
};

enum class Strategy { DDP, FSDP, HSDP, ZeRO, DistributedOptimizer };

// One micro-batch's forward and backward through `forward`; all but the last of a step under
// `no_sync` (when given). Returns its loss.
template <class Forward>
double microbatch_backward(Forward&& forward, int step, int m, bool last,
                           parallel::DataParallelWrapper* no_sync) {
  const auto [x, y] = microbatch(step, m);
  auto run = [&, x = x, y = y] {
    Tensor loss = mse_loss(forward(x), y);
    loss.backward();
    return loss.item<double>();
  };
  if (last || no_sync == nullptr) return run();
  const parallel::NoSyncGuard accumulate = no_sync->no_sync();
  return run();
}

std::vector<std::vector<float>> values_of(const nn::NamedTensors& state) {
  std::vector<std::vector<float>> out;
  for (const auto& [name, t] : state) out.push_back(t.to(kFloat32).to_vector<float>());
  return out;
}

// kSteps SGD steps, clipped to 0.5, of the micro-batches `mine` (global indices, run in this
// order) with `strategy` in reproducible mode over `group` (HSDP: shard groups of `group`'s
// halves, replicated across them).
StepResult run(const dist::Group& group, const std::vector<int>& mine,
               Strategy strategy = Strategy::DDP) {
  auto model = make_model();
  std::unique_ptr<parallel::DataParallelWrapper> wrapper;
  std::unique_ptr<parallel::ZeroRedundancyOptimizer> zero;
  std::unique_ptr<optim::SGD> sgd;
  std::unique_ptr<parallel::DistributedOptimizer> averaging;
  const optim::SGDOptions sgd_options{.lr = 0.1};
  if (strategy == Strategy::DDP) {
    wrapper = std::make_unique<DistributedDataParallel>(
        *model, parallel::DDPOptions{.group = group, .reproducible = true});
  } else if (strategy == Strategy::FSDP || strategy == Strategy::HSDP) {
    parallel::FSDPOptions options{.units = {"0", "2"}, .group = group, .reproducible = true};
    if (strategy == Strategy::HSDP) {
      const parallel::ProcessMesh mesh({.data = dist::world_size(), .replicate = 2});
      options.group = mesh.shard(), options.replicate_group = mesh.replicate();
    }
    wrapper = std::make_unique<parallel::FullyShardedDataParallel>(*model, options);
  } else if (strategy == Strategy::ZeRO) {
    zero = std::make_unique<parallel::ZeroRedundancyOptimizer>(
        model->parameters(),
        [&](std::vector<Tensor> shard) {
          return std::make_unique<optim::SGD>(std::move(shard), sgd_options);
        },
        group, parallel::ZeroOptions{.max_grad_norm = 0.5, .reproducible = true});
  }
  if (wrapper) sgd = std::make_unique<optim::SGD>(wrapper->trained_parameters(), sgd_options);
  if (strategy == Strategy::DistributedOptimizer) {
    sgd = std::make_unique<optim::SGD>(model->parameters(), sgd_options);
    averaging = std::make_unique<parallel::DistributedOptimizer>(
        *sgd, parallel::DistributedOptimizerOptions{.group = group, .reproducible = true});
  }
  StepResult result;
  for (int step = 0; step < kSteps; ++step) {
    if (zero)
      zero->zero_grad();
    else
      sgd->zero_grad();
    double losses = 0;
    for (size_t i = 0; i < mine.size(); ++i)
      losses += microbatch_backward(
          [&](const Tensor& x) { return wrapper ? wrapper->forward(x) : (*model)(x); }, step,
          mine[i], i + 1 == mine.size(), wrapper.get());
    result.loss = dist::exact_sum(losses, group) / kMicrobatches;
    if (zero) {
      zero->step();
      result.norm = zero->last_grad_norm();
      continue;
    }
    if (averaging) averaging->average_gradients();
    result.norm = parallel::clip_grad_norm_(sgd->params(), 0.5, 2.0, group);
    sgd->step();
  }
  result.values = values_of(wrapper ? wrapper->full_state_dict() : model->state_dict());
  return result;
}

bool same_bits(const StepResult& a, const StepResult& b) {
  if (a.values.size() != b.values.size()) return false;
  for (size_t i = 0; i < a.values.size(); ++i)
    if (a.values[i].size() != b.values[i].size() ||
        std::memcmp(a.values[i].data(), b.values[i].data(), a.values[i].size() * sizeof(float)) !=
            0)
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
    // Close to float64 training on the mean of the micro-batches' losses (clipped alike).
    auto model = make_model(kFloat64);
    optim::SGD sgd(model->parameters(), {.lr = 0.1});
    double norm = 0;
    for (int step = 0; step < kSteps; ++step) {
      sgd.zero_grad();
      for (int m = 0; m < kMicrobatches; ++m) {
        auto [x, y] = microbatch(step, m, kFloat64);
        (mse_loss((*model)(x), y) / double(kMicrobatches)).backward();
      }
      norm = optim::clip_grad_norm_(model->parameters(), 0.5);
      sgd.step();
    }
    CHECK(one.norm == doctest::Approx(norm).epsilon(1e-5));
    const std::vector<std::vector<float>> expected = values_of(model->state_dict());
    for (size_t i = 0; i < expected.size(); ++i)
      CHECK(test::close(from_vector(one.values[i]), from_vector(expected[i]), 1e-4, 1e-6));
  }

  TEST_CASE("FSDP, HSDP, ZeRO-1 and DistributedOptimizer end with DDP's bits at one process") {
    std::vector<int> all(kMicrobatches);
    for (int m = 0; m < kMicrobatches; ++m) all[size_t(m)] = m;
    const StepResult one = run(alone(), all);
    const std::vector<int> mine = my_microbatches();
    CHECK(same_bits(run(dist::world(), mine, Strategy::FSDP), one));
    CHECK(same_bits(run(dist::world(), mine, Strategy::ZeRO), one));
    CHECK(same_bits(run(dist::world(), mine, Strategy::DistributedOptimizer), one));
    if (dist::world_size() % 2 == 0)
      CHECK(same_bits(run(dist::world(), mine, Strategy::HSDP), one));
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
      std::pair<Tensor, Tensor> batch = microbatch(0, 0, kFloat32, odd ? kRows + 1 : kRows);
      if (dist::world_size() == 1) {  // one rank: a second micro-batch of another size
        const parallel::NoSyncGuard accumulate = ddp.no_sync();
        mse_loss(ddp(batch.first), batch.second).backward();
        batch = microbatch(0, 1, kFloat32, kRows);
      }
      const std::string error =
          test::error_of([&] { mse_loss(ddp(batch.first), batch.second).backward(); });
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

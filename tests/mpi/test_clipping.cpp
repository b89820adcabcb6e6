// Gradient clipping where the parameters are spread over ranks: FSDP's and ZeRO's clipping
// equal one process clipping the whole model on the stacked batches (norm and parameters, at
// 1-4 ranks, both FSDP sharding modes), and optim::clip_grad_norm_ refuses a rank's part of a
// spread parameter (FSDP shard, ZeRO slice, tensor-parallel slice), naming the right call.
#include <doctest/doctest.h>

#include <cmath>
#include <memory>
#include <string>

#include "fsdp_helpers.h"
#include "helpers.h"
#include "weave/weave.h"

using namespace weave;
using namespace weave::test::fsdp;

namespace {

constexpr int kSteps = 4;
// Small enough that every step clips (the infinity norm of a step is about 0.05 here).
constexpr double kMaxNorm = 0.02;

// One process on the stacked batches: mean loss, clip, AdamW; the norm before clipping per step.
std::vector<double> reference_run(nn::Module& model, double norm_type) {
  optim::AdamW adamw(model.parameters(), adamw_options());
  std::vector<double> norms;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step);
    adamw.zero_grad();
    mse_loss(model.forward(x), y).backward();
    norms.push_back(optim::clip_grad_norm_(model.parameters(), kMaxNorm, norm_type));
    adamw.step();
  }
  return norms;
}

}  // namespace

TEST_SUITE("clipping") {
  TEST_CASE("FSDP clip_grad_norm_ equals one process clipping the whole model") {
    for (auto sharding :
         {parallel::ShardingStrategy::FullShard, parallel::ShardingStrategy::ShardGradOp}) {
      for (double norm_type : {2.0, 1.0, double(INFINITY)}) {
        CAPTURE(int(sharding));
        CAPTURE(norm_type);
        auto reference = make_model(3), model = make_model(3);
        const std::vector<double> expected = reference_run(*reference, norm_type);
        parallel::FullyShardedDataParallel fsdp(*model, {.sharding = sharding});
        optim::AdamW adamw(fsdp.parameters(), adamw_options());
        for (int step = 0; step < kSteps; ++step) {
          auto [x, y] = local_batch(step);
          adamw.zero_grad();
          mse_loss(fsdp(x), y).backward();
          const double norm = fsdp.clip_grad_norm_(kMaxNorm, norm_type);
          CHECK(norm == doctest::Approx(expected[size_t(step)]).epsilon(1e-12));
          CHECK(norm > kMaxNorm);  // it clipped
          adamw.step();
        }
        CHECK(max_difference(*reference, fsdp) < 1e-12);
      }
    }
  }

  TEST_CASE("ZeRO's max_grad_norm equals one process clipping the whole model") {
    auto reference = make_model(5), model = make_model(5);
    const std::vector<double> expected = reference_run(*reference, 2.0);
    parallel::ZeroRedundancyOptimizer zero(model->parameters(),
                                           [](std::vector<Tensor> shard) {
                                             return std::make_unique<optim::AdamW>(std::move(shard),
                                                                                   adamw_options());
                                           },
                                           std::nullopt, {.max_grad_norm = kMaxNorm});
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = local_batch(step);
      zero.zero_grad();
      // The mean over this rank's rows: ZeRO averages over the ranks, which makes the global mean.
      mse_loss(model->forward(x), y).backward();
      zero.step();
      CHECK(zero.last_grad_norm() == doctest::Approx(expected[size_t(step)]).epsilon(1e-12));
    }
    test::check_params(*model, reference->parameters());
  }

  TEST_CASE("optim::clip_grad_norm_ refuses a rank's part of a spread parameter, naming the call") {
    if (dist::world_size() < 2) {  // one rank's part is the whole: clipping it is right
      auto model = make_model(1);
      parallel::FullyShardedDataParallel fsdp(*model);
      auto [x, y] = local_batch(0);
      mse_loss(fsdp(x), y).backward();
      CHECK(std::isfinite(optim::clip_grad_norm_(fsdp.parameters(), 1.0)));
      return;
    }
    auto model = make_model(1);
    parallel::FullyShardedDataParallel fsdp(*model);
    auto [x, y] = local_batch(0);
    mse_loss(fsdp(x), y).backward();
    CHECK_WEAVE_ERROR(optim::clip_grad_norm_(fsdp.parameters(), 1.0), "clip_grad_norm_",
                      "clip with fsdp.clip_grad_norm_(max_norm)");
    auto replica = make_model(1);
    parallel::ZeroRedundancyOptimizer zero(replica->parameters(), [](std::vector<Tensor> shard) {
      return std::make_unique<optim::SGD>(std::move(shard), optim::SGDOptions{.lr = 0.1});
    });
    CHECK_WEAVE_ERROR(optim::clip_grad_norm_(zero.shard_optimizer().params(), 1.0),
                      "clip_grad_norm_", "ZeroOptions::max_grad_norm");
    CHECK(std::isfinite(optim::clip_grad_norm_(replica->parameters(), 1.0)));  // replicas: fine
    // A tensor-parallel slice keeps its mark through Module::to.
    parallel::ColumnParallelLinear column(4, 2 * dist::world_size(), dist::world());
    column.to(kFloat64);
    mse_loss(column(ones({3, 4}, {.dtype = kFloat64})), zeros({3, 2}, {.dtype = kFloat64}))
        .backward();
    CHECK_WEAVE_ERROR(optim::clip_grad_norm_(column.parameters(), 1.0), "clip_grad_norm_",
                      "parallel::clip_grad_norm_(params, max_norm)");
  }
}

// join(): ranks with different numbers of batches. Each case compares every rank's parameters
// with one process training on the stacked batches of the ranks that still had one at each step
// (the loss of each rank's batch summed and divided by the world size: a rank out of batches
// contributes zeros), or checks the error on every rank.
#include <doctest/doctest.h>

#include <memory>
#include <string>

#include "helpers.h"
#include "weave/weave.h"

using namespace weave;
using parallel::DistributedDataParallel;
using test::check_params;
using test::error_of;

namespace {

constexpr int64_t kRows = 3;

// Batches per rank: rank 0 runs out first at 2 ranks, and the counts differ at every size.
int batches_of(int rank) {
  static const int counts[] = {3, 5, 2, 4};
  return counts[rank % 4];
}

std::pair<Tensor, Tensor> batch(int rank, int step) {
  Generator g(1000 + 100 * uint64_t(rank) + uint64_t(step));
  return {randn({kRows, 5}, {.dtype = kFloat64}, &g), randn({kRows, 2}, {.dtype = kFloat64}, &g)};
}

std::shared_ptr<nn::Sequential> make_model(uint64_t seed) {
  manual_seed(seed);
  auto model = std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(5, 6), nn::Tanh(), std::make_shared<nn::Linear>(6, 2)});
  model->to(kFloat64);
  return model;
}

optim::AdamWOptions adamw_options() {
  return {.lr = 0.05, .weight_decay = 0.01};
}

// One process: at each step, the summed losses of the ranks that still have a batch, over n.
std::vector<Tensor> reference_params() {
  const int n = dist::world_size();
  int steps = 0;
  for (int r = 0; r < n; ++r) steps = std::max(steps, batches_of(r));
  auto model = make_model(0);
  optim::AdamW optimizer(model->parameters(), adamw_options());
  for (int step = 0; step < steps; ++step) {
    optimizer.zero_grad();
    Tensor loss = zeros({}, {.dtype = kFloat64});
    for (int r = 0; r < n; ++r)
      if (step < batches_of(r)) {
        auto [x, y] = batch(r, step);
        loss = loss + mse_loss((*model)(x), y);
      }
    (loss / double(n)).backward();
    optimizer.step();
  }
  return model->parameters();
}

// This rank's training loop: `step_fn(loss)` runs backward and the optimizer step.
template <class Forward, class Step>
void train_my_batches(Forward&& forward, Step&& step_fn) {
  for (int step = 0; step < batches_of(dist::rank()); ++step) {
    auto [x, y] = batch(dist::rank(), step);
    step_fn(mse_loss(forward(x), y));
  }
}

}  // namespace

TEST_SUITE("join") {
  TEST_CASE("uneven batches under join() equal one process on the stacked batches") {
    const std::vector<Tensor> expected = reference_params();
    for (double bucket_mb : {1e-9, 25.0}) {
      CAPTURE(bucket_mb);
      auto model = make_model(dist::rank() == 0 ? 0 : 7);  // DDP broadcasts rank 0's
      DistributedDataParallel ddp(*model, {.first_bucket_mb = bucket_mb, .bucket_mb = bucket_mb});
      optim::AdamW optimizer(model->parameters(), adamw_options());
      parallel::join({ddp, optimizer}, [&] {
        train_my_batches([&](const Tensor& x) { return ddp(x); },
                         [&](const Tensor& loss) {
                           optimizer.zero_grad(false);
                           loss.backward();
                           optimizer.step();
                         });
      });
      check_params(*model, expected);
    }
    SUBCASE("ZeroRedundancyOptimizer") {
      auto model = make_model(0);
      parallel::ZeroRedundancyOptimizer zero(model->parameters(), [](std::vector<Tensor> shard) {
        return std::make_unique<optim::AdamW>(shard, adamw_options());
      });
      parallel::join({zero}, [&] {
        train_my_batches([&](const Tensor& x) { return (*model)(x); },
                         [&](const Tensor& loss) {
                           zero.zero_grad();
                           loss.backward();
                           zero.step();
                         });
      });
      check_params(*model, expected);
    }
    SUBCASE("DistributedOptimizer") {
      auto model = make_model(0);
      optim::AdamW adamw(model->parameters(), adamw_options());
      parallel::DistributedOptimizer optimizer(adamw, {.bucket_mb = 1e-9});
      parallel::join({optimizer}, [&] {
        train_my_batches([&](const Tensor& x) { return (*model)(x); },
                         [&](const Tensor& loss) {
                           optimizer.zero_grad();
                           loss.backward();
                           optimizer.step();
                         });
      });
      check_params(*model, expected);
    }
    SUBCASE("DecentralizedDataParallel: an idle rank mixes without stepping") {
      // Reference without join(): every rank takes every step, a rank out of batches with a
      // zero loss (plain SGD then leaves its parameters as they are, and it still mixes).
      int steps = 0;
      for (int r = 0; r < dist::world_size(); ++r) steps = std::max(steps, batches_of(r));
      auto sgd = [](std::vector<Tensor> bucket) {
        return std::make_unique<optim::SGD>(std::move(bucket), optim::SGDOptions{.lr = 0.1});
      };
      const parallel::DecentralizedOptions options{
          .topology = dist::world_size() % 2 == 0 ? "ring" : "complete", .bucket_mb = 1e-9};
      auto reference = make_model(0);
      {
        parallel::DecentralizedDataParallel dec(*reference, sgd, options);
        for (int step = 0; step < steps; ++step) {
          auto [x, y] = batch(dist::rank(), step);
          Tensor loss = mse_loss(dec(x), y);
          (step < batches_of(dist::rank()) ? loss : loss * 0.0).backward();
        }
        dec.wait();
      }
      auto model = make_model(0);
      parallel::DecentralizedDataParallel dec(*model, sgd, options);
      parallel::join({dec}, [&] {
        train_my_batches([&](const Tensor& x) { return dec(x); },
                         [&](const Tensor& loss) { loss.backward(); });
      });
      dec.wait();
      CHECK(dec.steps() == steps);
      check_params(*model, reference->parameters());
    }
    SUBCASE("FullyShardedDataParallel, both sharding modes") {
      for (auto sharding :
           {parallel::ShardingStrategy::FullShard, parallel::ShardingStrategy::ShardGradOp}) {
        CAPTURE(int(sharding));
        auto model = make_model(0);
        parallel::FullyShardedDataParallel fsdp(*model, {.sharding = sharding});
        optim::AdamW optimizer(fsdp.parameters(), adamw_options());
        parallel::join({fsdp, optimizer}, [&] {
          train_my_batches([&](const Tensor& x) { return fsdp(x); },
                           [&](const Tensor& loss) {
                             optimizer.zero_grad();
                             loss.backward();
                             optimizer.step();
                           });
        });
        const nn::NamedTensors full = fsdp.full_state_dict();
        REQUIRE(full.size() == expected.size());
        for (size_t i = 0; i < full.size(); ++i) {
          CAPTURE(full[i].first);
          CHECK(allclose(full[i].second, expected[i], 1e-11, 1e-13));
        }
      }
    }
  }

  TEST_CASE("join(): a rank that raises after its DDP or FSDP forward, or inside backward") {
    const int n = dist::world_size(), failing = n - 1;
    for (bool sharded : {false, true})
      for (bool in_backward : {false, true}) {
        CAPTURE(sharded);
        CAPTURE(in_backward);
        auto model = make_model(0);
        std::unique_ptr<DistributedDataParallel> ddp;
        std::unique_ptr<parallel::FullyShardedDataParallel> fsdp;
        if (sharded)
          fsdp = std::make_unique<parallel::FullyShardedDataParallel>(*model);
        else
          ddp = std::make_unique<DistributedDataParallel>(*model);
        optim::AdamW optimizer(sharded ? fsdp->parameters() : model->parameters(), adamw_options());
        auto joined = [&]() -> parallel::Joined {
          if (sharded) return *fsdp;
          return *ddp;
        };
        const std::string message = error_of([&] {
          parallel::join({joined(), optimizer}, [&] {
            for (int step = 0; step < 4; ++step) {
              auto [x, y] = batch(dist::rank(), step);
              optimizer.zero_grad();
              Tensor out = sharded ? (*fsdp)(x) : (*ddp)(x);
              if (dist::rank() == failing && step == 2) {
                if (!in_backward) WEAVE_FAIL("test", "rank {} fails on purpose", failing);
                out.register_hook([failing](const Tensor&) -> Tensor {
                  WEAVE_FAIL("test", "rank {} fails on purpose", failing);
                });
              }
              mse_loss(out, y).backward();
              optimizer.step();
            }
          });
        });
        if (dist::rank() == failing)
          CHECK_MESSAGE(message.find("fails on purpose") != std::string::npos, message);
        else
          CHECK_MESSAGE(message.find("in step 2") != std::string::npos, message);
        // The group is still usable and in step.
        Tensor t = ones({3});
        dist::all_reduce(t);
        CHECK(t.to_vector<float>()[0] == float(n));
      }
  }

  TEST_CASE("join(): a loop that raises on one rank raises on every rank") {
    const int n = dist::world_size(), failing = n - 1;
    auto model = make_model(0);
    DistributedDataParallel ddp(*model);
    optim::AdamW optimizer(model->parameters(), adamw_options());
    const std::string message = error_of([&] {
      parallel::join({ddp, optimizer}, [&] {
        for (int step = 0; step < 4; ++step) {
          WEAVE_CHECK(!(dist::rank() == failing && step == 2), "test", "rank {} fails on purpose",
                      failing);
          auto [x, y] = batch(dist::rank(), step);
          optimizer.zero_grad(false);
          mse_loss(ddp(x), y).backward();
          optimizer.step();
        }
      });
    });
    if (dist::rank() == failing)
      CHECK(message.find("fails on purpose") != std::string::npos);
    else
      CHECK(message.find("1 rank(s) of group") != std::string::npos);
    // The group is still usable and in step.
    Tensor t = ones({3});
    dist::all_reduce(t);
    CHECK(t.to_vector<float>()[0] == float(n));
  }

  TEST_CASE("join(): listing DDP without its optimizer is caught when the replicas differ") {
    const int n = dist::world_size();
    auto model = make_model(0);
    DistributedDataParallel ddp(*model);
    optim::AdamW optimizer(model->parameters(), adamw_options());
    const std::string message = error_of([&] {
      parallel::join({ddp}, [&] {
        train_my_batches([&](const Tensor& x) { return ddp(x); },
                         [&](const Tensor& loss) {
                           optimizer.zero_grad(false);
                           loss.backward();
                           optimizer.step();
                         });
      });
    });
    if (n == 1)
      CHECK(message.empty());
    else
      CHECK(message.find("list the optimizer after the DDP wrapper") != std::string::npos);
  }

  TEST_CASE("join(): a rank without a single batch cannot shadow DDP; every rank raises") {
    const int n = dist::world_size(), idle = n - 1;
    if (n == 1) return;
    auto model = make_model(0);
    DistributedDataParallel ddp(*model);
    optim::AdamW optimizer(model->parameters(), adamw_options());
    const std::string message = error_of([&] {
      parallel::join({ddp, optimizer}, [&] {
        if (dist::rank() == idle) return;
        auto [x, y] = batch(dist::rank(), 0);
        optimizer.zero_grad(false);
        mse_loss(ddp(x), y).backward();
        optimizer.step();
      });
    });
    if (dist::rank() == idle)
      CHECK(message.find("ran out of inputs before its DistributedDataParallel's first") !=
            std::string::npos);
    else
      CHECK(message.find("ran out of inputs before they could shadow") != std::string::npos);
  }

  TEST_CASE("set_step: ranks in different training steps raise instead of pairing") {
    const int n = dist::world_size();
    if (n == 1) return;
    const dist::Group group = dist::new_group([&] {
      std::vector<int> all(n);
      for (int r = 0; r < n; ++r) all[r] = r;
      return all;
    }());
    dist::set_step(group, dist::rank() == 0 ? 8 : 9);
    Tensor t = ones({4});
    const std::string message = error_of([&] { dist::all_reduce(t, dist::ReduceOp::Sum, group); });
    CHECK(message.find("training step") != std::string::npos);
    CHECK(message.find("in step 8") != std::string::npos);
    CHECK(message.find("in step 9") != std::string::npos);
    dist::set_step(group, 10);
    dist::all_reduce(t, dist::ReduceOp::Sum, group);
    CHECK(t.to_vector<float>()[0] == float(n));
  }
}

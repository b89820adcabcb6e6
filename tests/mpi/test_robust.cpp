// Training that cannot go silently wrong: a backward that fails or is skipped on one rank, a
// parameter without gradient on one rank, non-finite gradients, buffers updated in forward,
// parameter lists that differ between ranks. Each case compares with one process training on
// the stacked batches (skipping what every rank skipped), or checks the error on every rank.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <new>
#include <string>

#include "helpers.h"
#include "weave/weave.h"

using namespace weave;
using parallel::DistributedDataParallel;
using test::check_params;

namespace {

constexpr int64_t kRows = 4;  // per rank

// Fails on purpose in backward while armed (a gradient hook, a custom Function, an allocation).
bool armed = false;

struct ThrowInBackward : autograd::Function<ThrowInBackward> {
  static Tensor forward(autograd::FunctionContext&, const Tensor& x) { return x * 1.0; }
  static std::vector<Tensor> backward(autograd::FunctionContext&, const std::vector<Tensor>& g) {
    if (armed) throw std::bad_alloc();  // not a weave::Error: any exception type must do
    return {g[0]};
  }
};

// A layer that passes its input through the throwing Function.
struct Tripwire : nn::Module {
  Tripwire() : Module("Tripwire") {}
  Tensor forward(const Tensor& x) override { return ThrowInBackward::apply(x); }
};

std::shared_ptr<nn::Sequential> make_model(uint64_t seed) {
  manual_seed(seed);
  auto model = std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(5, 7), nn::Tanh(), std::make_shared<nn::Linear>(7, 6),
      std::make_shared<Tripwire>(), nn::Tanh(), std::make_shared<nn::Linear>(6, 3)});
  model->to(kFloat64);
  return model;
}

std::pair<Tensor, Tensor> global_batch(int step) {
  Generator g(777 + uint64_t(step));
  const int64_t rows = kRows * dist::world_size();
  return {randn({rows, 5}, {.dtype = kFloat64}, &g), randn({rows, 3}, {.dtype = kFloat64}, &g)};
}
Tensor mine(const Tensor& t) {
  return t.narrow(0, dist::rank() * kRows, kRows);
}

// One process, SGD on the mean loss of the stacked batches, skipping `skipped`.
std::vector<Tensor> reference_params(int steps, int skipped, double lr) {
  auto model = make_model(0);
  optim::SGD sgd(model->parameters(), {.lr = lr});
  for (int step = 0; step < steps; ++step) {
    if (step == skipped) continue;
    auto [x, y] = global_batch(step);
    sgd.zero_grad();
    mse_loss((*model)(x), y).backward();
    sgd.step();
  }
  return model->parameters();
}

enum class Where { LossHook, MiddleFunction, LeafHook, SkippedBackward };
const char* name_of(Where w) {
  switch (w) {
    case Where::LossHook:
      return "a hook on the output, before any parameter's gradient";
    case Where::MiddleFunction:
      return "a custom Function between layers, after some buckets launched";
    case Where::LeafHook:
      return "a hook on the first layer's weight, the last gradient";
    case Where::SkippedBackward:
      return "a rank that skips its backward";
  }
  return "";
}

}  // namespace

TEST_SUITE("robust") {
  TEST_CASE("a backward that fails or is skipped on one rank: every rank skips that step") {
    const int n = dist::world_size(), failing = n - 1, steps = 6;
    const double lr = 0.1;
    for (Where where :
         {Where::LossHook, Where::MiddleFunction, Where::LeafHook, Where::SkippedBackward}) {
      for (int fail_step : {0, 2}) {  // the first (tracing) backward, and a later one
        for (double bucket_mb : {1e-9, 25.0}) {
          CAPTURE(name_of(where));
          CAPTURE(fail_step);
          CAPTURE(bucket_mb);
          // Every rank starts elsewhere; DDP broadcasts rank 0's model.
          auto model = make_model(dist::rank() == 0 ? 0 : 11 + uint64_t(dist::rank()));
          DistributedDataParallel ddp(*model,
                                      {.first_bucket_mb = bucket_mb, .bucket_mb = bucket_mb});
          optim::SGD sgd(model->parameters(), {.lr = lr});
          bool leaf_armed = false;
          HookHandle leaf_hook =
              model->parameters()[0].register_post_accumulate_grad_hook([&leaf_armed](Tensor&) {
                if (leaf_armed) throw Error("[test] the first layer's hook failed on purpose");
              });
          std::string message;
          int raised = 0;
          for (int step = 0; step < steps; ++step) {
            const bool here = step == fail_step && dist::rank() == failing;
            auto [x, y] = global_batch(step);
            sgd.zero_grad();
            try {
              Tensor out = ddp(mine(x));
              if (here && where == Where::LossHook)
                out.register_hook([](const Tensor&) -> Tensor {
                  throw Error("[test] the output's hook failed on purpose");
                });
              Tensor loss = mse_loss(out, mine(y));
              if (here && where == Where::SkippedBackward) continue;
              armed = here && where == Where::MiddleFunction;
              leaf_armed = here && where == Where::LeafHook;
              loss.backward();
              sgd.step();
            } catch (const std::exception& e) {
              ++raised;
              message = e.what();
            }
            armed = leaf_armed = false;
          }
          leaf_hook.remove();
          // Every rank trained as one process that skipped that batch.
          check_params(*model, reference_params(steps, fail_step, lr));
          if (dist::rank() == failing) {
            if (where == Where::SkippedBackward) {
              CHECK(raised == 0);  // it chose to skip: nothing to report to itself
            } else {
              CHECK(raised == 1);
              CHECK_MESSAGE(
                  message.find(where == Where::MiddleFunction ? "bad_alloc" : "on purpose") !=
                      std::string::npos,
                  message);
            }
          } else {
            CHECK(raised == 1);
            CHECK_MESSAGE(message.find("failed or skipped backward in step " +
                                       std::to_string(fail_step)) != std::string::npos,
                          message);
          }
          CHECK(ddp.stats().failed_steps == 1);
          CHECK(ddp.stats().steps == steps);
        }
      }
    }
  }

  TEST_CASE("evaluation forwards in grad mode warn once, are counted, and training goes on") {
    const int evaluations = 4;
    const double lr = 0.1;
    auto model = make_model(0);
    DistributedDataParallel ddp(*model);
    optim::SGD sgd(model->parameters(), {.lr = lr});
    const std::string printed = test::stderr_of([&] {
      for (int i = 0; i < evaluations; ++i) (void)ddp(mine(global_batch(100 + i).first));
      auto [x, y] = global_batch(0);  // then one training step, on every rank alike
      sgd.zero_grad();
      mse_loss(ddp(mine(x)), mine(y)).backward();
      sgd.step();
    });
    size_t warnings = 0;
    for (size_t at = printed.find("got no backward"); at != std::string::npos;
         at = printed.find("got no backward", at + 1))
      ++warnings;
    CHECK_MESSAGE(warnings == 1, printed);
    CHECK_MESSAGE(printed.find("NoGradGuard") != std::string::npos, printed);
    CHECK_MESSAGE(printed.find("no_sync()") != std::string::npos, printed);
    CHECK(ddp.stats().failed_steps == evaluations);
    check_params(*model, reference_params(1, -1, lr));
  }

  TEST_CASE("a parameter without gradient on one rank raises on every rank, not just there") {
    if (dist::world_size() < 2) return;
    struct Branchy : nn::Module {
      std::shared_ptr<nn::Linear> a, c;
      Branchy() : Module("Branchy") {
        manual_seed(5);
        a = register_module("a", std::make_shared<nn::Linear>(5, 3));
        c = register_module("c", std::make_shared<nn::Linear>(5, 3));
        to(kFloat64);
      }
      Tensor forward(const Tensor& x) override {
        Tensor y = (*a)(x);
        if (dist::rank() == 0) y = y + (*c)(x);  // c gets no gradient on the other ranks
        return y;
      }
    };
    Branchy model;
    DistributedDataParallel ddp(model);
    for (int step = 0; step < 2; ++step) {  // the tracing backward and a later one
      CAPTURE(step);
      const auto batch = global_batch(step);  // (clang 14 cannot capture bindings)
      const Tensor x = batch.first, y = batch.second;
      const std::string message = test::error_of([&] {
        model.zero_grad();
        mse_loss(ddp(mine(x)), mine(y)).backward();
      });
      if (dist::rank() == 0)
        CHECK_MESSAGE(message.find("rank(s) of group") != std::string::npos, message);
      else
        CHECK_MESSAGE(
            message.find("got no gradient in this backward: [\"c.weight\", \"c.bias\"]") !=
                std::string::npos,
            message);
    }
  }

  TEST_CASE("check_finite: a NaN in one rank's batch raises on every rank; skipping recovers") {
    const int n = dist::world_size(), poisoned = n - 1, steps = 4;
    const double lr = 0.1;
    auto model = make_model(0);
    DistributedDataParallel ddp(*model, {.check_finite = true});
    optim::SGD sgd(model->parameters(), {.lr = lr});
    int raised = 0;
    for (int step = 0; step < steps; ++step) {
      const auto batch = global_batch(step);  // (clang 14 cannot capture bindings)
      const Tensor x = batch.first, y = batch.second;
      Tensor input = mine(x).clone();
      if (step == 1 && dist::rank() == poisoned) input.narrow(0, 0, 1).fill_(std::nan(""));
      sgd.zero_grad();
      const std::string message = test::error_of([&] {
        mse_loss(ddp(input), mine(y)).backward();
        sgd.step();
      });
      CHECK(ddp.gradients_finite() == (step != 1));
      if (step == 1) {
        ++raised;
        CHECK_MESSAGE(message.find("hold NaN or infinity (first in ") != std::string::npos,
                      message);
      } else {
        CHECK(message.empty());
      }
    }
    CHECK(raised == 1);
    check_params(*model, reference_params(steps, 1, lr));
  }

  TEST_CASE("DDP broadcasts buffers that forward updates, before every training forward") {
    // A running statistic updated from each rank's own batch, as batch norm does.
    struct Running : nn::Module {
      std::shared_ptr<nn::Linear> fc;
      Tensor seen;  // the statistic as forward found it
      Running() : Module("Running") {
        manual_seed(1);
        fc = register_module("fc", std::make_shared<nn::Linear>(5, 3));
        register_buffer("mean", zeros({5}, {.dtype = kFloat32}));
        to(kFloat64);
      }
      Tensor forward(const Tensor& x) override {
        Tensor stat = named_buffers().front().second;  // a handle: updates land in the buffer
        seen = stat.clone();
        stat.mul_(0.5).add_(weave::mean(x.detach(), {0}) * 0.5);
        return (*fc)(x);
      }
    };
    const int n = dist::world_size();
    for (bool broadcast : {true, false}) {
      CAPTURE(broadcast);
      Running model;
      DistributedDataParallel ddp(model, {.broadcast_buffers = broadcast});
      Tensor expected;  // rank 0's statistic, computed here from its batches
      for (int step = 0; step < 3; ++step) {
        auto [x, y] = global_batch(step);
        model.zero_grad();
        mse_loss(ddp(mine(x)), mine(y)).backward();
        Tensor all = empty({n, 5}, {.dtype = kFloat64});
        dist::all_gather(all, model.seen.unsqueeze(0));
        bool same = true;
        for (int r = 1; r < n; ++r) same = same && equal(all.select(0, r), all.select(0, 0));
        if (broadcast || step == 0 || n == 1)
          CHECK(same);
        else
          CHECK_FALSE(same);  // without the broadcast the replicas drift apart
      }
      // Evaluation under NoGradGuard does not broadcast (one rank may evaluate alone).
      if (dist::rank() == 0) {
        NoGradGuard no_grad;
        ddp(mine(global_batch(9).first));
      }
    }
  }

  TEST_CASE("ZeRO and DistributedOptimizer check their parameters across ranks") {
    if (dist::world_size() < 2) return;
    auto model = make_model(0);
    std::vector<Tensor> params = model->parameters();
    // Same shapes, same total size, another order on rank 1: the weights of two layers of one
    // shape would silently swap; here the two biases [7] and [6] and a swap of equal shapes.
    std::vector<Tensor> reordered = params;
    if (dist::rank() == 1) std::swap(reordered[0], reordered[2]);
    const std::string zero_error = test::error_of([&] {
      parallel::ZeroRedundancyOptimizer zero(reordered, [](std::vector<Tensor> shard) {
        return std::make_unique<optim::SGD>(std::move(shard), optim::SGDOptions{.lr = 0.1});
      });
    });
    CHECK_MESSAGE(zero_error.find("[ZeroRedundancyOptimizer] ranks disagree on the parameters: "
                                  "entry 0") != std::string::npos,
                  zero_error);
    optim::SGD sgd(reordered, {.lr = 0.1});
    const std::string dist_error =
        test::error_of([&] { parallel::DistributedOptimizer wrapped(sgd); });
    CHECK_MESSAGE(dist_error.find("[DistributedOptimizer] ranks disagree on the parameters") !=
                      std::string::npos,
                  dist_error);
    // Same shapes in the same order but different values (replicas never synchronized).
    auto other = make_model(uint64_t(dist::rank()));
    const std::string value_error = test::error_of([&] {
      parallel::ZeroRedundancyOptimizer zero(other->parameters(), [](std::vector<Tensor> shard) {
        return std::make_unique<optim::SGD>(std::move(shard), optim::SGDOptions{.lr = 0.1});
      });
    });
    CHECK_MESSAGE(value_error.find("values differ") != std::string::npos, value_error);
  }

  TEST_CASE("bucket sizes of 0, -1 and NaN raise in every bucketed wrapper, on every rank") {
    auto model = make_model(0);
    optim::SGD sgd(model->parameters(), {.lr = 0.1});
    const auto make_sgd = [](std::vector<Tensor> bucket) {
      return std::make_unique<optim::SGD>(std::move(bucket), optim::SGDOptions{.lr = 0.1});
    };
    for (double bad : {0.0, -1.0, std::nan("")}) {
      CAPTURE(bad);
      CHECK_WEAVE_ERROR(DistributedDataParallel(*model, {.bucket_mb = bad}),
                        "DistributedDataParallel", "bucket sizes must be positive");
      CHECK_WEAVE_ERROR(DistributedDataParallel(*model, {.first_bucket_mb = bad}),
                        "DistributedDataParallel", "bucket sizes must be positive");
      CHECK_WEAVE_ERROR(parallel::DecentralizedDataParallel(*model, make_sgd, {.bucket_mb = bad}),
                        "DecentralizedDataParallel", "bucket sizes must be positive");
      CHECK_WEAVE_ERROR(
          parallel::DecentralizedDataParallel(*model, make_sgd, {.first_bucket_mb = bad}),
          "DecentralizedDataParallel", "bucket sizes must be positive");
      CHECK_WEAVE_ERROR(parallel::DistributedOptimizer(sgd, {.bucket_mb = bad}),
                        "DistributedOptimizer", "bucket sizes must be positive");
    }
    // The refusals sent nothing: the group still agrees on its next collective.
    Tensor one = ones({1});
    dist::all_reduce(one);
    CHECK(one.item<double>() == double(dist::world_size()));
  }

  TEST_CASE("DistributedOptimizer and ZeRO with check_finite skip the step on every rank") {
    const int n = dist::world_size(), poisoned = n - 1, steps = 4;
    const double lr = 0.1;
    for (bool zero : {false, true}) {
      CAPTURE(zero);
      auto model = make_model(0);
      optim::SGD sgd(model->parameters(), {.lr = lr});
      parallel::DistributedOptimizer dist_opt(sgd, {.check_finite = true});
      std::unique_ptr<parallel::ZeroRedundancyOptimizer> zero_opt;
      if (zero)
        zero_opt = std::make_unique<parallel::ZeroRedundancyOptimizer>(
            model->parameters(),
            [lr](std::vector<Tensor> shard) {
              return std::make_unique<optim::SGD>(std::move(shard), optim::SGDOptions{.lr = lr});
            },
            std::nullopt, parallel::ZeroOptions{.check_finite = true});
      int skipped = 0;
      for (int step = 0; step < steps; ++step) {
        auto [x, y] = global_batch(step);
        Tensor input = mine(x).clone();
        if (step == 2 && dist::rank() == poisoned) input.narrow(0, 1, 1).fill_(INFINITY);
        model->zero_grad();
        mse_loss((*model)(input), mine(y)).backward();
        const bool stepped = zero ? zero_opt->step() : dist_opt.step();
        skipped += stepped ? 0 : 1;
        CHECK(stepped == (step != 2));
      }
      CHECK(skipped == 1);
      check_params(*model, reference_params(steps, 2, lr));
    }
  }

  TEST_CASE("pipeline argument errors raise on every stage before anything is sent") {
    const int n = dist::world_size(), me = dist::rank(), last = n - 1;
    manual_seed(3);
    nn::Sequential model;
    for (int i = 0; i < std::max(n, 2); ++i) model.push_back(std::make_shared<nn::Linear>(4, 4));
    auto stage = parallel::pipeline_stage(model, me, n);
    auto mse = [](const Tensor& out, const Tensor& y) { return mse_loss(out, y); };
    // Each case's error on the stage that made it, and on every other stage.
    auto expect_everywhere = [&](const std::string& message, int culprit, const std::string& own,
                                 const std::string& others) {
      CAPTURE(message);
      CHECK(message.find(me == culprit ? own : others) != std::string::npos);
    };
    const std::string rejected = "rejected its arguments";
    SUBCASE("the stages disagree on micro-batches") {
      const std::string message = test::error_of(
          [&] { parallel::Pipeline pipe(*stage, {.microbatches = me == last ? 4 : 2}); });
      if (n > 1) CHECK(message.find("disagree on microbatches (from 2 to 4") != std::string::npos);
      if (n == 1) CHECK(message.empty());
    }
    SUBCASE("one stage's options are invalid") {
      const std::string message = test::error_of(
          [&] { parallel::Pipeline pipe(*stage, {.microbatches = me == last ? 0 : 2}); });
      expect_everywhere(message, last, "microbatches must be at least 1", rejected);
    }
    parallel::Pipeline pipe(*stage, {.microbatches = 2});
    const Tensor x = ones({4, 4}), y = zeros({4, 4});
    SUBCASE("a batch that does not divide into micro-batches") {
      const std::string message = test::error_of([&] { pipe.train_step(ones({3, 4}), y, mse); });
      expect_everywhere(message, 0, "does not divide into 2 micro-batches", rejected);
    }
    SUBCASE("no loss on the last stage") {
      const std::string message = test::error_of([&] { pipe.train_step(x, y, nullptr); });
      expect_everywhere(message, last, "the last stage needs a loss function", rejected);
    }
    SUBCASE("inputs and targets of different batch sizes") {
      const std::string message = test::error_of([&] { pipe.train_step(x, zeros({6, 4}), mse); });
      CHECK(message.find("inputs have batch size 4 but the last stage's targets 6") !=
            std::string::npos);
    }
    // After any of these, the pipeline still trains.
    Tensor loss = pipe.train_step(x, y, mse);
    CHECK(loss.defined() == (me == last));
  }

  TEST_CASE("in a data x tensor mesh, a sampler or wrapper left on the default group raises") {
    const int n = dist::world_size();
    if (n < 2 || n % 2 != 0) return;
    {
      parallel::ProcessMesh mesh({.data = n / 2, .tensor = 2});
      auto expect_trap = [](const std::string& message, const char* op) {
        CAPTURE(message);
        CHECK(message.find(fmt::format("[{}] no group was given, and a ProcessMesh", op)) !=
              std::string::npos);
        CHECK(message.find("mesh.data()") != std::string::npos);
      };
      expect_trap(test::error_of([] { parallel::DistributedSampler sampler(100); }),
                  "DistributedSampler");
      auto model = make_model(0);
      expect_trap(test::error_of([&] { DistributedDataParallel ddp(*model); }),
                  "DistributedDataParallel");
      expect_trap(test::error_of([&] {
                    parallel::ZeroRedundancyOptimizer zero(
                        model->parameters(), [](std::vector<Tensor> shard) {
                          return std::make_unique<optim::SGD>(std::move(shard),
                                                              optim::SGDOptions{.lr = 0.1});
                        });
                  }),
                  "ZeroRedundancyOptimizer");
      // Given the data group, the sampler splits over the data ranks only: both ranks of a
      // tensor group read the same batches.
      parallel::DistributedSampler sampler(100, {.seed = 5}, mesh.data());
      Tensor mine = from_vector(sampler.indices(), {sampler.size()});
      Tensor theirs = mine.clone();
      dist::broadcast(theirs, 0, mesh.tensor());
      CHECK(equal(mine, theirs));
    }
    // Without a mesh, the default is the world again.
    parallel::DistributedSampler sampler(100);
    CHECK(sampler.size() == (100 + n - 1) / n);
  }

  TEST_CASE("a training state saved by rank 0 does not restore its data order on another rank") {
    const int n = dist::world_size();
    if (n < 2) return;
    Generator g(4);
    auto dataset =
        std::make_shared<data::TensorDataset>(randn({20, 5}, {}, &g), randn({20, 3}, {}, &g));
    auto make_loader = [&](std::shared_ptr<parallel::DistributedSampler> sampler) {
      return data::DataLoader(dataset, {.batch_size = 2, .sampler = std::move(sampler)});
    };
    auto sampler = std::make_shared<parallel::DistributedSampler>(
        20, parallel::DistributedSamplerOptions{.seed = 9});
    sampler->set_epoch(2);
    data::DataLoader loader = make_loader(sampler);
    auto batch = loader.begin();
    *batch;
    ++batch;  // one batch handed out
    const std::string dir = test::shared_dir("rank0_state");
    if (dist::rank() == 0) std::filesystem::create_directories(dir);
    dist::barrier();
    const std::string path = dir + "/state.safetensors";
    auto model = make_model(0);
    data::TrainingState state{.model = model.get(), .loader = &loader};
    if (dist::rank() == 0) data::save_checkpoint(path, state);
    dist::barrier();
    const std::string message = test::error_of([&] { data::load_checkpoint(path, state); });
    if (dist::rank() == 0) {
      CHECK(message.empty());
    } else {
      CAPTURE(message);
      CHECK(message.find(fmt::format("holds the data loader of replica 0 of {}", n)) !=
            std::string::npos);
      CHECK(message.find(fmt::format("restoring it on replica {} would", dist::rank())) !=
            std::string::npos);
    }
    // Saved without the loader, the replicated parts load on every rank; the sampler's own
    // state (epoch and seed) holds nothing of one rank's, so it carries over too.
    dist::barrier();
    data::TrainingState model_only{.model = model.get()};
    if (dist::rank() == 0) data::save_checkpoint(path, model_only);
    dist::barrier();
    CHECK(test::error_of([&] { data::load_checkpoint(path, model_only); }).empty());
    auto restored = std::make_shared<parallel::DistributedSampler>(20);
    restored->load_state(sampler->state());
    CHECK(sampler->state() == "epoch 2 seed 9 drawn 2");
    CHECK(restored->indices_from(0) == sampler->indices_from(0));  // not a pass: no warning
    restored->load_state("3");  // the bare epoch older checkpoints wrote
    CHECK(restored->epoch() == 3);
    CHECK(!test::error_of([&] { restored->load_state("epoch x"); }).empty());
    dist::barrier();
    if (dist::rank() == 0) std::filesystem::remove_all(dir);
  }
}

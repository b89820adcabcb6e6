// FullyShardedDataParallel when something goes wrong: a forward or backward that raises on one
// rank, a skipped backward, and ranks that construct it differently. Every rank must learn of
// the failure in the same step, and the steps after it must equal, bitwise, a run that never
// took the failed step.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "fsdp_helpers.h"
#include "helpers.h"
#include "weave/weave.h"

using namespace weave;
using namespace weave::test::fsdp;
using parallel::DistributedDataParallel;
using parallel::FSDPOptions;
using parallel::FullyShardedDataParallel;
using parallel::ShardingStrategy;
using test::error_of;

namespace {

// Trains `steps` steps under FSDP (each rank its slice of the batch), skipping step `skipped`,
// and returns the gathered parameters: the run a failed step must equal.
nn::NamedTensors clean_run(const FSDPOptions& options, int steps, int skipped) {
  auto model = make_model(100);
  FullyShardedDataParallel fsdp(*model, options);
  optim::AdamW opt(fsdp.parameters(), adamw_options());
  for (int step = 0; step < steps; ++step) {
    if (step == skipped) continue;
    auto [batch_x, batch_y] = local_batch(step);
    Tensor x = batch_x, y = batch_y;  // named: clang before 16 cannot capture a binding
    opt.zero_grad();
    mse_loss(fsdp(x), y).backward();
    opt.step();
  }
  return fsdp.full_state_dict();
}

void check_bitwise_equal(const nn::NamedTensors& a, const nn::NamedTensors& b) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    CAPTURE(a[i].first);
    CHECK(a[i].first == b[i].first);
    CHECK(equal(a[i].second, b[i].second));
  }
}

}  // namespace

TEST_SUITE("fsdp") {
  TEST_CASE(
      "a forward that raises on one rank: the step fails everywhere, the next ones are exact") {
    if (dist::world_size() < 2) return;
    const int failing = dist::world_size() - 1;
    for (auto sharding : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp}) {
      // Where it raises: as unit 0, 1 or 2 begins (module 0, 2 or 4, just gathered), in the
      // first step (the forward order not yet learned) or a later one; in grad mode, or in an
      // evaluation forward (no backward follows; nothing is skipped).
      for (int module : {0, 2, 4})
        for (int failed_step : {0, 2})
          for (bool evaluating : {false, true}) {
            CAPTURE(int(sharding));
            CAPTURE(module);
            CAPTURE(failed_step);
            CAPTURE(evaluating);
            const FSDPOptions options{.sharding = sharding};
            auto model = make_model(100);
            FullyShardedDataParallel fsdp(*model, options);
            optim::AdamW opt(fsdp.parameters(), adamw_options());
            bool armed = false;
            HookHandle hook = (*model)[size_t(module)].register_forward_pre_hook(
                [&](nn::Module&, const Tensor&) -> Tensor {
                  if (armed && dist::rank() == failing) WEAVE_FAIL("test", "injected failure");
                  return Tensor();
                });
            for (int step = 0; step < failed_step + 4; ++step) {
              CAPTURE(step);
              auto [batch_x, batch_y] = local_batch(step);
              Tensor x = batch_x, y = batch_y;  // named: clang before 16 cannot capture a binding
              opt.zero_grad();
              armed = step == failed_step;
              if (armed && evaluating) {
                NoGradGuard no_grad;
                const std::string error = error_of([&] { fsdp(x); });
                CHECK((dist::rank() == failing) == !error.empty());
                continue;
              }
              const std::string error = error_of([&] { mse_loss(fsdp(x), y).backward(); });
              if (!armed) {
                CHECK_MESSAGE(error.empty(), error);
                opt.step();
                continue;
              }
              const std::string expected =
                  dist::rank() == failing
                      ? "injected failure"
                      : "failed in forward or backward in step " + std::to_string(failed_step);
              CHECK_MESSAGE(error.find(expected) != std::string::npos, error);
              for (const Tensor& shard : fsdp.parameters()) CHECK_FALSE(shard.grad().defined());
            }
            hook.remove();
            CHECK(fsdp.stats().failed_steps == (evaluating ? 0 : 1));
            check_bitwise_equal(fsdp.full_state_dict(),
                                clean_run(options, failed_step + 4, failed_step));
          }
    }
  }

  TEST_CASE("check_finite: an infinite input on one rank raises on every rank; the rest is exact") {
    const int odd = dist::world_size() - 1;
    for (auto sharding : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp}) {
      CAPTURE(int(sharding));
      auto model = make_model(100);
      FullyShardedDataParallel fsdp(*model, {.sharding = sharding, .check_finite = true});
      optim::AdamW opt(fsdp.parameters(), adamw_options());
      // One process on the stacked batches, skipping the step the check rejects.
      auto reference = make_model(100);
      optim::AdamW reference_opt(reference->parameters(), adamw_options());
      for (int step = 0; step < 4; ++step) {
        CAPTURE(step);
        auto [batch_x, batch_y] = local_batch(step);
        Tensor x = batch_x, y = batch_y;  // named: clang before 16 cannot capture a binding
        if (step == 1 && dist::rank() == odd) {
          x = x.clone();
          x.narrow(0, 0, 1).fill_(INFINITY);
        }
        opt.zero_grad();
        const std::string error = error_of([&] { mse_loss(fsdp(x), y).backward(); });
        if (step == 1) {
          CHECK_MESSAGE(error.find("hold NaN or infinity") != std::string::npos, error);
          CHECK_FALSE(fsdp.gradients_finite());
          continue;
        }
        CHECK_MESSAGE(error.empty(), error);
        CHECK(fsdp.gradients_finite());
        opt.step();
        auto [all_x, all_y] = global_batch(step);
        reference_opt.zero_grad();
        mse_loss((*reference)(all_x), all_y).backward();
        reference_opt.step();
      }
      CHECK(fsdp.stats().failed_steps == 0);
      CHECK(max_difference(*reference, fsdp) <= 1e-10);
    }
  }

  TEST_CASE("a backward that fails or is skipped on one rank: every rank discards the step") {
    if (dist::world_size() < 2) return;
    const int failing = dist::world_size() - 1;
    // Where the failing rank's backward stops in step 1: below layer 1's Tanh (units 2 and 1
    // done), below layer 3's Tanh (unit 2 done, unit 1's prefetch issued), or not at all: it
    // skips backward, and settles the step at its next forward.
    for (int where : {1, 3, -1}) {
      CAPTURE(where);
      auto reference = make_model(100), model = make_model(100);
      DistributedDataParallel ddp(*reference);
      optim::AdamW reference_opt(reference->parameters(), adamw_options());
      FullyShardedDataParallel fsdp(*model);
      optim::AdamW opt(fsdp.parameters(), adamw_options());
      bool armed = false;
      HookHandle hook;
      if (where >= 0)
        hook = (*model)[size_t(where)].register_forward_hook(
            [&](nn::Module&, const Tensor&, const Tensor& out) {
              if (armed && dist::rank() == failing)
                out.register_hook(
                    [](const Tensor&) -> Tensor { WEAVE_FAIL("test", "injected failure"); });
              return Tensor();
            });
      for (int step = 0; step < 4; ++step) {
        CAPTURE(step);
        auto [batch_x, batch_y] = local_batch(step);
        Tensor x = batch_x, y = batch_y;  // named: clang before 16 cannot capture a binding
        opt.zero_grad();
        armed = step == 1;
        std::string error;
        try {
          Tensor loss = mse_loss(fsdp(x), y);
          if (!(armed && where < 0 && dist::rank() == failing)) loss.backward();
        } catch (const Error& e) {
          error = e.what();
        }
        if (step == 1) {
          // The failing rank reports its own error (none when it skipped); the others name it.
          const std::string expected = dist::rank() != failing
                                           ? "failed in forward or backward in step 1"
                                       : where >= 0 ? "injected failure"
                                                    : "";
          const bool reported =
              expected.empty() ? error.empty() : error.find(expected) != std::string::npos;
          CHECK_MESSAGE(reported, error);
          if (dist::rank() != failing || where >= 0)
            for (const Tensor& shard : fsdp.parameters()) CHECK_FALSE(shard.grad().defined());
          continue;  // every rank skips the step, as the reference does
        }
        CHECK_MESSAGE(error.empty(), error);
        reference_opt.zero_grad();
        mse_loss(ddp(x), y).backward();
        reference_opt.step();
        opt.step();
      }
      CHECK(fsdp.stats().failed_steps == 1);
      CHECK(max_difference(*reference, fsdp) <= 1e-10);
    }
  }

  TEST_CASE("bad inputs, other models, other units or options: every rank raises at construction") {
    // A unit that names no module.
    auto model = make_model(1);
    CHECK_WEAVE_ERROR(FullyShardedDataParallel(*model, {.units = {"0", "fc9"}}),
                      "FullyShardedDataParallel", "'fc9' names no submodule");
    // Ranks with different models (rank 1 has an extra layer).
    if (dist::world_size() > 1) {
      manual_seed(1);
      auto other =
          std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
              std::make_shared<nn::Linear>(5, 16), nn::Tanh(),
              std::make_shared<nn::Linear>(16, dist::rank() == 1 ? 8 : 9)});
      CHECK_WEAVE_ERROR(FullyShardedDataParallel(*other), "FullyShardedDataParallel",
                        "ranks disagree on the model");
    }
    CHECK_WEAVE_ERROR(FullyShardedDataParallel(*model, {.unit_mb = -1}), "FullyShardedDataParallel",
                      "unit_mb must be a finite size");
    CHECK_WEAVE_ERROR(FullyShardedDataParallel(*model, {.unit_mb = std::nan("")}),
                      "FullyShardedDataParallel", "unit_mb must be a finite size");
    CHECK_WEAVE_ERROR(FullyShardedDataParallel(*model, {.broadcast_from = dist::world_size()}),
                      "FullyShardedDataParallel", "broadcast_from must be a rank");
    if (dist::world_size() < 2) return;
    // The last rank differs from the others in one thing at a time.
    const bool odd = dist::rank() == dist::world_size() - 1;
    using parallel::FSDPOptions;
    using parallel::ShardingStrategy;
    const std::vector<std::pair<FSDPOptions, FSDPOptions>> cases = {
        {{.units = {"0", "2", "4"}}, {.units = {"0", "4", "2"}}},
        {{.sharding = ShardingStrategy::FullShard}, {.sharding = ShardingStrategy::ShardGradOp}},
        {{.unit_mb = 0}, {.unit_mb = 0.5}},
        {{.reshard_after_forward = true}, {.reshard_after_forward = false}},
        {{.prefetch = true}, {.prefetch = false}},
        {{.broadcast_from = 0}, {.broadcast_from = 1}},
    };
    for (size_t i = 0; i < cases.size(); ++i) {
      CAPTURE(i);
      auto fresh = make_model(1);
      CHECK_WEAVE_ERROR(FullyShardedDataParallel(*fresh, odd ? cases[i].second : cases[i].first),
                        "FullyShardedDataParallel", "ranks disagree on the options and units");
    }
  }

  TEST_CASE("two forwards and one backward of their sum: no warning, the gradients of both") {
    for (bool fsdp_wrapped : {true, false}) {
      CAPTURE(fsdp_wrapped);
      auto reference = make_model(9), model = make_model(9);
      // One process: the two batches' losses summed, per step.
      optim::AdamW want(reference->parameters(), adamw_options());
      for (int step = 0; step < 3; ++step) {
        auto [x1, y1] = global_batch(2 * step);
        auto [x2, y2] = global_batch(2 * step + 1);
        want.zero_grad();
        (mse_loss(reference->forward(x1), y1) + mse_loss(reference->forward(x2), y2)).backward();
        want.step();
      }
      std::unique_ptr<FullyShardedDataParallel> fsdp;
      std::unique_ptr<DistributedDataParallel> ddp;
      if (fsdp_wrapped)
        fsdp = std::make_unique<FullyShardedDataParallel>(*model);
      else
        ddp = std::make_unique<DistributedDataParallel>(*model);
      optim::AdamW opt(fsdp ? fsdp->parameters() : model->parameters(), adamw_options());
      const std::string printed = test::stderr_of([&] {
        for (int step = 0; step < 3; ++step) {
          auto [x1, y1] = local_batch(2 * step);
          auto [x2, y2] = local_batch(2 * step + 1);
          opt.zero_grad();
          Tensor first = fsdp ? (*fsdp)(x1) : (*ddp)(x1);
          Tensor second = fsdp ? (*fsdp)(x2) : (*ddp)(x2);
          (mse_loss(first, y1) + mse_loss(second, y2)).backward();
          opt.step();
        }
      });
      CHECK_MESSAGE(printed.find("got no backward") == std::string::npos, printed);
      if (fsdp) {
        CHECK(fsdp->stats().failed_steps == 0);
        CHECK(max_difference(*reference, *fsdp) < 1e-12);
      } else {
        CHECK(ddp->stats().failed_steps == 0);
        test::check_params(*model, reference->parameters());
      }
    }
  }

  TEST_CASE("a forward that skips a unit on one rank: every rank raises, realigns, goes on") {
    if (dist::world_size() < 2) return;
    // Rank 1's forward leaves out the middle unit in step 2 (a data-dependent branch): the
    // ranks' gathers stop pairing. Every rank must raise in that step, and the steps after it
    // must equal a run that never took it: nothing of the failed step may leak into them.
    struct Branchy : nn::Module {
      std::shared_ptr<nn::Linear> a, b, c;
      bool skip = false;
      Branchy() {
        manual_seed(5);
        a = register_module("a", std::make_shared<nn::Linear>(5, 7));
        b = register_module("b", std::make_shared<nn::Linear>(7, 7));
        c = register_module("c", std::make_shared<nn::Linear>(7, 3));
        to(kFloat64);
      }
      Tensor forward(const Tensor& x) override {
        Tensor h = tanh((*a)(x));
        if (!skip) h = tanh((*b)(h));
        return (*c)(h);
      }
    };
    constexpr int kSteps = 5, kSkipped = 2;
    auto run = [&](FullyShardedDataParallel& fsdp, Branchy& model,
                   std::vector<std::string>& errors) {
      optim::AdamW opt(fsdp.parameters(), adamw_options());
      for (int step = 0; step < kSteps; ++step) {
        auto [batch_x, batch_y] = local_batch(step);
        Tensor x = batch_x, y = batch_y;  // named: clang before 16 cannot capture a binding
        model.skip = step == kSkipped && dist::rank() == 1;
        errors.push_back(error_of([&] {
          opt.zero_grad();
          mse_loss(fsdp(x), y).backward();
          opt.step();
        }));
      }
    };
    // FullShard: the skipping rank's gathers differ, so every rank raises in step 2, and the
    // rest equals a run without step 2, bitwise.
    const FSDPOptions full{.units = {"a", "b", "c"}};
    Branchy clean;
    FullyShardedDataParallel clean_fsdp(clean, full);
    optim::AdamW clean_opt(clean_fsdp.parameters(), adamw_options());
    for (int step = 0; step < kSteps; ++step) {
      if (step == kSkipped) continue;
      auto [x, y] = local_batch(step);
      clean_opt.zero_grad();
      mse_loss(clean_fsdp(x), y).backward();
      clean_opt.step();
    }
    for (int attempt = 0; attempt < 20; ++attempt) {
      CAPTURE(attempt);
      Branchy model;
      FullyShardedDataParallel fsdp(model, full);
      std::vector<std::string> errors;
      run(fsdp, model, errors);
      for (int step = 0; step < kSteps; ++step) {
        CAPTURE(step);
        if (step == kSkipped)
          CHECK_MESSAGE(errors[step].find("collective mismatch") != std::string::npos,
                        errors[step]);
        else
          CHECK_MESSAGE(errors[step].empty(), errors[step]);
      }
      CHECK(fsdp.stats().failed_steps == 1);
      check_bitwise_equal(fsdp.full_state_dict(), clean_fsdp.full_state_dict());
    }
    // ShardGradOp keeps the parameters gathered: the collectives pair, and the skipped unit's
    // gradient on rank 1 is zero, as it is in one process that runs both ranks' batches.
    Branchy reference;
    optim::AdamW reference_opt(reference.parameters(), adamw_options());
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = global_batch(step);
      reference_opt.zero_grad();
      Tensor loss;
      for (int r = 0; r < dist::world_size(); ++r) {
        reference.skip = step == kSkipped && r == 1;
        Tensor part = mse_loss(reference(x.narrow(0, r * kLocalBatch, kLocalBatch)),
                               y.narrow(0, r * kLocalBatch, kLocalBatch));
        loss = loss.defined() ? loss + part : part;
      }
      (loss / double(dist::world_size())).backward();
      reference_opt.step();
    }
    for (int attempt = 0; attempt < 5; ++attempt) {
      CAPTURE(attempt);
      Branchy model;
      FullyShardedDataParallel fsdp(
          model, {.sharding = ShardingStrategy::ShardGradOp, .units = {"a", "b", "c"}});
      std::vector<std::string> errors;
      run(fsdp, model, errors);
      for (const std::string& error : errors) CHECK_MESSAGE(error.empty(), error);
      CHECK(max_difference(reference, fsdp) <= 1e-12);
    }
  }

  TEST_CASE("the wrapped model handed to a checkpoint: the hint names fsdp.sharded_module()") {
    if (dist::world_size() < 2) return;  // at 1 rank nothing is released
    auto model = make_model(4);
    FullyShardedDataParallel fsdp(*model);
    data::TrainingState state{.model = model.get()};
    const std::string dir = test::shared_dir("fsdp_wrapped_model");
    const std::string error = error_of([&] { parallel::save_sharded_checkpoint(dir, state); });
    CHECK_MESSAGE(error.find("give checkpoints fsdp.sharded_module()") != std::string::npos, error);
    dist::barrier();
    if (dist::rank() == 0) std::filesystem::remove_all(dir);
  }
}

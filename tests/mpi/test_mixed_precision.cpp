// Mixed precision across ranks: the loss scaler's verdict is the group's (one rank's overflow
// skips the step everywhere, parameters bitwise unchanged, the same scale on every rank) under
// DDP, DistributedOptimizer and ZeRO; DDP with bfloat16 parameters against one process on the
// stacked batch.
#include <doctest/doctest.h>

#include <cmath>
#include <memory>

#include "helpers.h"
#include "weave/weave.h"

using namespace weave;

namespace {

constexpr int64_t kLocalBatch = 4;

std::shared_ptr<nn::Sequential> make_model(uint64_t seed, DType dtype = kFloat32) {
  manual_seed(seed);
  auto model = std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(5, 16), nn::Tanh(), std::make_shared<nn::Linear>(16, 3)});
  model->to(dtype);
  return model;
}

std::pair<Tensor, Tensor> global_batch(int step, DType dtype = kFloat32) {
  Generator g(777 + uint64_t(step));
  const int64_t rows = kLocalBatch * dist::world_size();
  return {randn({rows, 5}, {}, &g).to(dtype), randn({rows, 3}, {}, &g).to(dtype)};
}

Tensor local_rows(const Tensor& t) {
  return t.narrow(0, dist::rank() * kLocalBatch, kLocalBatch);
}

// The rank that overflows alone: rank 1 (rank 0 in a world of one).
bool overflowing_rank() {
  return dist::rank() == std::min(1, dist::world_size() - 1);
}

std::vector<Tensor> snapshot(nn::Module& model) {
  std::vector<Tensor> out;
  for (const Tensor& p : model.parameters()) out.push_back(p.detach().clone());
  return out;
}

void check_bitwise_equal(nn::Module& model, const std::vector<Tensor>& expected) {
  auto params = model.parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    CAPTURE(i);
    CHECK(equal(params[i].detach(), expected[i]));
  }
}

// Every rank holds the same scale (gathered and compared).
void check_same_scale_everywhere(double scale) {
  Tensor mine = full({1}, scale, {.dtype = kFloat64});
  Tensor all = zeros({dist::world_size()}, {.dtype = kFloat64});
  dist::all_gather(all, mine);
  CHECK(equal(all, full({dist::world_size()}, scale, {.dtype = kFloat64})));
}

enum class Wrapper { DDP, DistributedOptimizer, Zero };

// Trains 6 steps; at step 3 only the overflowing rank's gradients hold inf (under DDP through
// its loss, so the average carries it; under the others injected after backward into its local
// gradient only, which the average would not reach before the step decision).
void run_scaler_case(Wrapper wrapper) {
  auto model = make_model(5);
  parallel::broadcast_parameters(*model);
  std::unique_ptr<parallel::DistributedDataParallel> ddp;
  if (wrapper == Wrapper::DDP) ddp = std::make_unique<parallel::DistributedDataParallel>(*model);
  optim::SGD opt(model->parameters(), {.lr = 0.05, .momentum = 0.9});
  std::unique_ptr<parallel::DistributedOptimizer> dopt;
  if (wrapper == Wrapper::DistributedOptimizer)
    dopt = std::make_unique<parallel::DistributedOptimizer>(opt);
  std::unique_ptr<parallel::ZeroRedundancyOptimizer> zero;
  if (wrapper == Wrapper::Zero)
    zero = std::make_unique<parallel::ZeroRedundancyOptimizer>(
        model->parameters(), [](std::vector<Tensor> shard) {
          return std::make_unique<optim::SGD>(std::move(shard),
                                              optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
        });
  parallel::GradScaler scaler;
  const int overflow_step = 3;
  for (int step = 0; step < 6; ++step) {
    CAPTURE(step);
    auto [x, y] = global_batch(step);
    const bool inject = step == overflow_step && overflowing_rank();
    if (zero)
      zero->zero_grad(false);
    else
      opt.zero_grad(false);
    Tensor out = ddp ? (*ddp)(local_rows(x)) : (*model)(local_rows(x));
    Tensor loss = mse_loss(out, local_rows(y));
    if (inject && ddp) loss = loss * INFINITY;
    scaler.scale(loss).backward();
    if (inject && !ddp) {
      NoGradGuard no_grad;
      model->parameters()[0].grad().data<float>()[0] = INFINITY;
    }
    const auto before = snapshot(*model);
    const double scale_before = scaler.get_scale();
    bool stepped = false;
    if (wrapper == Wrapper::DDP) stepped = scaler.step(opt);
    if (dopt) stepped = scaler.step(opt.params(), [&] { dopt->step(); });
    if (zero) stepped = scaler.step(model->parameters(), [&] { zero->step(); });
    scaler.update();
    CHECK(stepped == (step != overflow_step));
    if (step == overflow_step) {
      check_bitwise_equal(*model, before);
      CHECK(scaler.get_scale() == scale_before * 0.5);
    } else {
      CHECK(scaler.get_scale() == scale_before);
    }
    check_same_scale_everywhere(scaler.get_scale());
  }
  // the replicas stayed equal
  for (const Tensor& p : model->parameters()) {
    Tensor reference = p.detach().clone();
    dist::broadcast(reference, 0);
    CHECK(equal(p.detach(), reference));
  }
}

}  // namespace

TEST_SUITE("mixed_precision") {
  TEST_CASE("GradScaler: one rank's overflow skips the step on every rank (DDP)") {
    run_scaler_case(Wrapper::DDP);
  }
  TEST_CASE("GradScaler: one rank's overflow skips the step on every rank (DistributedOptimizer)") {
    run_scaler_case(Wrapper::DistributedOptimizer);
  }
  TEST_CASE("GradScaler: one rank's overflow skips the step on every rank (ZeRO)") {
    run_scaler_case(Wrapper::Zero);
  }

  TEST_CASE("GradScaler with DecentralizedDataParallel: unscaled buckets, an agreed backoff") {
    auto sgd = [](std::vector<Tensor> bucket) {
      return std::make_unique<optim::SGD>(std::move(bucket), optim::SGDOptions{.lr = 0.05});
    };
    parallel::GradScaler scaler;
    auto model = make_model(uint64_t(dist::rank()) + 40),
         plain = make_model(uint64_t(dist::rank()) + 40);
    parallel::DecentralizedDataParallel dec(
        *model, sgd,
        {.topology = "complete", .first_bucket_mb = 1e-4, .bucket_mb = 1e-4, .scaler = &scaler});
    parallel::DecentralizedDataParallel reference(
        *plain, sgd, {.topology = "complete", .first_bucket_mb = 1e-4, .bucket_mb = 1e-4});
    for (int step = 0; step < 4; ++step) {
      CAPTURE(step);
      auto [x, y] = global_batch(step);
      const bool inject = step == 2 && overflowing_rank();
      Tensor loss = mse_loss(dec(local_rows(x)), local_rows(y));
      scaler.scale(inject ? loss * INFINITY : loss).backward();
      const double scale_before = scaler.get_scale();
      scaler.update();
      CHECK(scaler.get_scale() == (step == 2 ? scale_before * 0.5 : scale_before));
      check_same_scale_everywhere(scaler.get_scale());
      if (step < 2) {
        // a power-of-two scale unscales exactly: the same steps as without a scaler
        mse_loss(reference(local_rows(x)), local_rows(y)).backward();
        dec.wait();
        reference.wait();
        auto params = model->parameters(), expected = plain->parameters();
        for (size_t i = 0; i < params.size(); ++i)
          CHECK(equal(params[i].detach(), expected[i].detach()));
      }
    }
    dec.wait();
    for (const Tensor& p : model->parameters())
      CHECK(sum(isfinite(p.detach()).to(kInt64)).item<int64_t>() == p.numel());
  }

  TEST_CASE("GradScaler: a rank without backward raises on every rank") {
    if (dist::world_size() < 2) return;  // needs a rank with and one without backward
    auto model = make_model(1);
    optim::SGD opt(model->parameters(), {.lr = 0.1});
    parallel::GradScaler scaler;
    if (dist::rank() == 0) {
      auto [x, y] = global_batch(0);
      scaler.scale(mse_loss((*model)(local_rows(x)), local_rows(y))).backward();
    }
    std::string message;
    try {
      scaler.step(opt);
    } catch (const Error& e) {
      message = e.what();
    }
    // the rank without gradients names its fault; the others raise with it
    CHECK(message.find(dist::rank() == 0 ? "rejected its arguments" : "no gradients to unscale") !=
          std::string::npos);
  }

  TEST_CASE("GradScaler: ranks that hold different scales or trackers raise on every rank") {
    if (dist::world_size() < 2) return;
    const bool odd = dist::rank() == dist::world_size() - 1;
    auto model = make_model(1);
    optim::SGD opt(model->parameters(), {.lr = 0.1});
    auto [x, y] = global_batch(0);
    // Built with another init_scale on one rank; then the same scale but another tracker (a
    // state restored from another rank's checkpoint).
    for (bool by_tracker : {false, true}) {
      CAPTURE(by_tracker);
      parallel::GradScaler scaler({.init_scale = odd && !by_tracker ? 1024.0 : 65536.0});
      if (by_tracker && odd) scaler.load_state_dict({{"scale", 65536.0}, {"growth_tracker", 7.0}});
      opt.zero_grad();
      scaler.scale(mse_loss((*model)(local_rows(x)), local_rows(y))).backward();
      const Tensor before = model->parameters()[0].detach().clone();
      const std::string message = test::error_of([&] { scaler.step(opt); });
      CHECK_MESSAGE(message.find("disagree on the loss scale") != std::string::npos, message);
      CHECK_MESSAGE(message.find(by_tracker ? "the growth tracker from 0 to 7"
                                            : "it ranges from 1024 to 65536") != std::string::npos,
                    message);
      CHECK(equal(model->parameters()[0].detach(), before));  // no rank stepped
    }
  }

  TEST_CASE("DDP with bfloat16 parameters equals one process on the stacked batch") {
    for (std::optional<DType> wire : {std::optional<DType>(), std::optional<DType>(kFloat32)}) {
      CAPTURE(wire.has_value());
      auto model = make_model(uint64_t(dist::rank()) * 31 + 2, kBFloat16);
      parallel::DistributedDataParallel ddp(*model, {.compress = wire});
      auto reference = make_model(2, kBFloat16);
      auto [x, y] = global_batch(0, kBFloat16);
      mse_loss(ddp(local_rows(x)), local_rows(y)).backward();
      mse_loss((*reference)(x), y).backward();
      auto params = model->parameters(), expected = reference->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        CAPTURE(i);
        REQUIRE(params[i].grad().dtype() == kBFloat16);
        // bfloat16 gradients of a sum split differently: within a few bfloat16 roundings
        CHECK(allclose(params[i].grad().to(kFloat32), expected[i].grad().to(kFloat32), 3e-2, 3e-3));
      }
    }
  }

  TEST_CASE("ZeRO refuses parameters of two dtypes in one flat buffer, on every rank") {
    Tensor a = ones({3}).requires_grad_(), b = ones({3}, {.dtype = kBFloat16}).requires_grad_();
    std::string message;
    try {
      parallel::ZeroRedundancyOptimizer zero({a, b}, [](std::vector<Tensor> shard) {
        return std::make_unique<optim::SGD>(std::move(shard), optim::SGDOptions{});
      });
    } catch (const Error& e) {
      message = e.what();
    }
    CHECK(message.find("share one dtype") != std::string::npos);
  }
}

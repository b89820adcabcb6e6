// FSDP's mixed-precision policy: float64 gathers and reductions over float64 parameters equal
// DDP; bfloat16 gathers halve the gathered bytes, keep float32 shards for the optimizer, and
// train as float32 does, within bfloat16's rounding.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include "fsdp_helpers.h"
#include "weave/weave.h"

using namespace weave;
using namespace weave::test::fsdp;
using parallel::DistributedDataParallel;
using parallel::FullyShardedDataParallel;

TEST_SUITE("fsdp") {
  TEST_CASE("a float64 policy over float64 parameters equals DDP after 20 AdamW steps") {
    auto reference = make_model(100), model = make_model(100);
    DistributedDataParallel ddp(*reference);
    optim::AdamW reference_opt(reference->parameters(), adamw_options());
    FullyShardedDataParallel fsdp(*model, {.param_dtype = kFloat64, .reduce_dtype = kFloat64});
    optim::AdamW opt(fsdp.parameters(), adamw_options());
    train_side_by_side(ddp, reference_opt, fsdp, opt, 20);
    CHECK(max_difference(*reference, fsdp) <= 1e-10);
  }

  TEST_CASE("a bfloat16 policy gathers half the bytes, steps float32 shards, trains as float32") {
    auto float32_model = [] {
      auto model = make_model(7);
      model->to(kFloat32);
      return model;
    };
    auto plain_model = float32_model(), mixed_model = float32_model(),
         low_wire_model = float32_model();
    FullyShardedDataParallel plain(*plain_model);
    FullyShardedDataParallel mixed(*mixed_model,
                                   {.param_dtype = kBFloat16, .reduce_dtype = kFloat32});
    FullyShardedDataParallel low_wire(*low_wire_model, {.param_dtype = kBFloat16});
    for (const Tensor& shard : mixed.parameters()) CHECK(shard.dtype() == kFloat32);
    const Tensor initial = mixed.parameters()[0].detach().clone();
    CHECK(mixed_model->parameters()[0].dtype() == kBFloat16);  // what the units compute with
    optim::AdamW plain_opt(plain.parameters(), adamw_options()),
        mixed_opt(mixed.parameters(), adamw_options()),
        low_wire_opt(low_wire.parameters(), adamw_options());
    double plain_loss = 0, mixed_loss = 0;
    for (int step = 0; step < 40; ++step) {
      auto [x64, y64] = local_batch(step);
      const Tensor x = x64.to(kFloat32), y = y64.to(kFloat32);
      for (optim::Optimizer* opt :
           std::initializer_list<optim::Optimizer*>{&plain_opt, &mixed_opt, &low_wire_opt})
        opt->zero_grad();
      Tensor a = mse_loss(plain(x), y), b = mse_loss(mixed(x).to(kFloat32), y);
      a.backward();
      b.backward();
      mse_loss(low_wire(x).to(kFloat32), y).backward();
      plain_opt.step();
      mixed_opt.step();
      low_wire_opt.step();
      if (step >= 30) plain_loss += a.item<double>(), mixed_loss += b.item<double>();
    }
    // Every gather moved bfloat16 (the same padded buffers), every reduction float32 or, with no
    // reduce_dtype, bfloat16.
    CHECK(plain.stats().gathers == mixed.stats().gathers);
    CHECK(mixed.stats().gathered_bytes * 2 == plain.stats().gathered_bytes);
    CHECK(mixed.stats().reduced_bytes == plain.stats().reduced_bytes);
    CHECK(low_wire.stats().reduced_bytes * 2 == plain.stats().reduced_bytes);
    CAPTURE(plain_loss);
    CAPTURE(mixed_loss);
    CHECK(std::abs(mixed_loss - plain_loss) <= 1e-2 * plain_loss);
    CHECK(mixed_loss != plain_loss);  // bfloat16 compute rounds: the policy took effect
    const Tensor moved = mixed.parameters()[0].detach() - initial;
    CHECK(weave::abs(moved).max().item<double>() > 1e-2);  // 40 steps of lr 1e-2 moved it
    // The whole state gathers the float32 shards: master weights, not their bfloat16 copies.
    for (const auto& [name, t] : mixed.full_state_dict()) CHECK(t.dtype() == kFloat32);
  }

  TEST_CASE("a policy with an integer dtype raises on every rank") {
    auto model = make_model(1);
    CHECK_THROWS_WITH_AS(FullyShardedDataParallel(*model, {.param_dtype = kInt64}),
                         doctest::Contains("floating dtypes"), Error);
  }

  TEST_CASE("CPU offload of parameters already on the host raises on every rank") {
    auto model = make_model(1);
    CHECK_THROWS_WITH_AS(FullyShardedDataParallel(*model, {.offload_to_cpu = true}),
                         doctest::Contains("offload_to_cpu moves the shards of CUDA parameters"),
                         Error);
  }

  TEST_CASE("float16 averages whose sum overflows float16 come out finite (divided first)") {
    // 40000 on every rank: the mean fits float16 (largest 65504), the sum of 3 or 4 does not.
    const int n = dist::world_size();
    auto near = [](const Tensor& t) {
      const Tensor error = abs(t.to(kFloat64) - 40000.0);
      return all_finite(t) && max(error).item<double>() <= 40000.0 / 256;  // float16's rounding
    };
    Tensor averaged = full({6}, 40000.0, {.dtype = kFloat16});
    dist::all_reduce(averaged, dist::ReduceOp::Avg);
    CHECK(near(averaged));
    Tensor shard = empty({2}, {.dtype = kFloat16});
    const Tensor whole = full({2 * n}, 40000.0, {.dtype = kFloat16});
    dist::reduce_scatter(shard, whole, dist::ReduceOp::Avg);
    CHECK(near(shard));
    CHECK(equal(whole, full({2 * n}, 40000.0, {.dtype = kFloat16})));  // the input is left alone
    Tensor reduced = full({3}, 40000.0, {.dtype = kFloat16});
    dist::reduce(reduced, dist::ReduceOp::Avg, 0);
    CHECK(near(reduced));  // the root's mean; the others' tensors as they were
    // FSDP reducing float16 gradients: each rank's gradient is 40000 per element.
    auto model = std::make_shared<nn::Linear>(4, 1, /*bias=*/false);
    {
      NoGradGuard no_grad;
      model->weight.fill_(1e-3);  // the forward stays small; the weight's gradient is x
    }
    FullyShardedDataParallel fsdp(*model, {.param_dtype = kFloat16, .reduce_dtype = kFloat16});
    sum(fsdp(full({1, 4}, 40000.0))).backward();
    const Tensor grad = fsdp.parameters()[0].grad();  // this rank's part of the 4 (then padding)
    const int64_t real = std::clamp<int64_t>(4 - dist::rank() * grad.numel(), 0, grad.numel());
    if (real > 0) CHECK(near(grad.narrow(0, 0, real)));
  }
}

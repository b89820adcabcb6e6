// Every parallel strategy on CUDA tensors against the same code on the CPU: DDP, FSDP (both
// shardings, and with CPU offload), ZeRO-1, tensor-parallel layers, pipelines, activation
// checkpointing, mixed precision, ring and all-to-all attention, expert parallelism, a
// tensor-parallel Llama with a padded vocabulary and its decoding. The CPU runs are the reference:
// the CPU suites already check each of them against one process. Under MPI the ranks share the GPU
// (staged through the host); under NCCL (world size 1 on one GPU) the same code runs device to
// device. Run only with --require-cuda, which skips them without a GPU.
#include <doctest/doctest.h>

#include <functional>
#include <memory>
#include <vector>

#include "weave/weave.h"

using namespace weave;

namespace {

Device gpu() {
  return dist::backend() == dist::Backend::NCCL ? dist::device() : Device::cuda(0);
}

using Run = std::function<std::vector<Tensor>(Device)>;

// `run` on the CPU and on the GPU gives the same tensors (each returned on the device it ran on).
void check_same_on_gpu(const Run& run, double rtol = 1e-9, double atol = 1e-11) {
  const std::vector<Tensor> on_cpu = run(kCPU);
  const std::vector<Tensor> on_gpu = run(gpu());
  REQUIRE(on_cpu.size() == on_gpu.size());
  REQUIRE(!on_cpu.empty());
  for (size_t i = 0; i < on_cpu.size(); ++i) {
    CAPTURE(i);
    REQUIRE(on_gpu[i].defined());
    CHECK(on_gpu[i].device() == gpu());
    REQUIRE(on_gpu[i].shape() == on_cpu[i].shape());
    const Tensor got = on_gpu[i].detach().cpu().to(kFloat64);
    const Tensor expected = on_cpu[i].detach().to(kFloat64);
    CHECK_MESSAGE(allclose(got, expected, rtol, atol),
                  "max |gpu - cpu| = ", max(abs(got - expected)).item<double>());
  }
}

// 5 -> 8 -> 8 -> 3 with tanh between, from `seed`, in `dtype` on `device`.
std::shared_ptr<nn::Sequential> mlp(uint64_t seed, Device device, DType dtype = kFloat64) {
  manual_seed(seed);
  auto model = std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(5, 8), nn::Tanh(), std::make_shared<nn::Linear>(8, 8),
      nn::Tanh(), std::make_shared<nn::Linear>(8, 3)});
  model->to(dtype);
  model->to(device);
  return model;
}

// This rank's rows of step `step`'s batch (different on every rank), on `device`.
std::pair<Tensor, Tensor> local_batch(int step, Device device, DType dtype = kFloat64) {
  Generator g(1000 + 17 * uint64_t(step) + 131 * uint64_t(dist::rank()));
  Tensor x = randn({6, 5}, {.dtype = kFloat64}, &g), y = randn({6, 3}, {.dtype = kFloat64}, &g);
  return {x.to(dtype).to(device), y.to(dtype).to(device)};
}

// The same values on every rank, on `device`.
Tensor shared(const Shape& shape, uint64_t seed, Device device) {
  Generator g(seed);
  return randn(shape, {.dtype = kFloat64}, &g).to(device);
}

std::vector<Tensor> values(const std::vector<Tensor>& params) {
  std::vector<Tensor> out;
  for (const Tensor& p : params) out.push_back(p.detach().clone());
  return out;
}

std::vector<Tensor> grads(const std::vector<Tensor>& params) {
  std::vector<Tensor> out;
  for (const Tensor& p : params)
    if (p.grad().defined()) out.push_back(p.grad().clone());
  return out;
}

}  // namespace

TEST_SUITE("cuda_parallel") {
  TEST_CASE("DDP on CUDA tensors equals the CPU run, one bucket and many") {
    for (double bucket_mb : {100.0, 1e-9}) {
      CAPTURE(bucket_mb);
      check_same_on_gpu([&](Device d) {
        auto model = mlp(11 + uint64_t(dist::rank()), d);  // DDP broadcasts rank 0's
        parallel::DistributedDataParallel ddp(
            *model, {.first_bucket_mb = bucket_mb, .bucket_mb = bucket_mb});
        optim::SGD sgd(model->parameters(), {.lr = 0.1, .momentum = 0.9});
        std::vector<Tensor> out;
        for (int step = 0; step < 3; ++step) {
          sgd.zero_grad();
          auto [x, y] = local_batch(step, d);
          Tensor loss = mse_loss(ddp(x), y);
          loss.backward();
          sgd.step();
          out.push_back(loss.detach());
        }
        for (const Tensor& v : values(model->parameters())) out.push_back(v);
        return out;
      });
    }
  }

  TEST_CASE("FSDP on CUDA tensors equals the CPU run: both shardings, and CPU offload") {
    // Offloaded, the shards, their gradients and Adam's moments live on the host.
    using parallel::ShardingStrategy;
    struct Case {
      ShardingStrategy sharding;
      bool offload;
    };
    for (const Case c :
         {Case{ShardingStrategy::FullShard, false}, Case{ShardingStrategy::ShardGradOp, false},
          Case{ShardingStrategy::FullShard, true}}) {
      CAPTURE(int(c.sharding));
      CAPTURE(c.offload);
      check_same_on_gpu([&](Device d) {
        const bool offload = c.offload && d.is_cuda();
        auto model = mlp(12, d);
        parallel::FullyShardedDataParallel fsdp(
            *model, {.sharding = c.sharding, .offload_to_cpu = offload});
        optim::AdamW adamw(fsdp.parameters(), {.lr = 1e-2});
        std::vector<Tensor> out;
        for (int step = 0; step < 3; ++step) {
          adamw.zero_grad();
          auto [x, y] = local_batch(step, d);
          Tensor loss = mse_loss(fsdp(x), y);
          loss.backward();
          for (const Tensor& shard : fsdp.parameters()) {
            REQUIRE(shard.grad().defined());
            CHECK(shard.device().is_cpu() == (offload || d.is_cpu()));
            CHECK(shard.grad().device() == shard.device());
          }
          adamw.step();
          out.push_back(loss.detach());
        }
        if (offload)
          for (const auto& [name, value] : adamw.state_dict().tensors)
            CHECK(value.device().is_cpu());
        for (const auto& [name, value] : fsdp.full_state_dict()) out.push_back(value.to(d));
        return out;
      });
    }
  }

  TEST_CASE("ZeRO-1 on CUDA tensors equals the CPU run") {
    check_same_on_gpu([](Device d) {
      auto model = mlp(13, d);
      parallel::ZeroRedundancyOptimizer zero(model->parameters(), [](std::vector<Tensor> p) {
        return std::make_unique<optim::AdamW>(std::move(p), optim::AdamWOptions{.lr = 1e-2});
      });
      std::vector<Tensor> out;
      for (int step = 0; step < 3; ++step) {
        zero.zero_grad();
        auto [x, y] = local_batch(step, d);
        mse_loss((*model)(x), y).backward();
        zero.step();
      }
      return values(model->parameters());
    });
  }

  TEST_CASE("tensor-parallel layers on CUDA tensors equal the CPU run") {
    const int n = dist::world_size();
    for (bool sequence_parallel : {false, true}) {
      CAPTURE(sequence_parallel);
      check_same_on_gpu([&](Device d) {
        const dist::Group tp = dist::world();
        Generator g(21);
        // [T, hidden]: the sequence on axis 0
        parallel::ColumnParallelLinear fc1(
            6, 4 * n, tp,
            {.sequence_parallel = sequence_parallel, .sequence_axis = 0, .generator = &g});
        parallel::RowParallelLinear fc2(
            4 * n, 3, tp,
            {.sequence_parallel = sequence_parallel, .sequence_axis = 0, .generator = &g});
        for (nn::Module* m : {static_cast<nn::Module*>(&fc1), static_cast<nn::Module*>(&fc2)}) {
          m->to(kFloat64);
          m->to(d);
        }
        Tensor x = shared({2 * n, 6}, 22, d), w = shared({2 * n, 3}, 23, d);
        if (sequence_parallel) {
          x = x.narrow(0, 2 * dist::rank(), 2).contiguous();
          w = w.narrow(0, 2 * dist::rank(), 2).contiguous();
        }
        x.requires_grad_(true);
        Tensor y = fc2(tanh(fc1(x)));
        (y * w).sum().backward();
        std::vector<Tensor> out{y.detach(), x.grad().clone()};
        for (const Tensor& gr : grads(fc1.parameters())) out.push_back(gr);
        for (const Tensor& gr : grads(fc2.parameters())) out.push_back(gr);
        return out;
      });
    }
  }

  TEST_CASE(
      "a tensor-parallel Llama with a padded vocabulary, and its decoding, on CUDA equal the CPU "
      "run") {
    // 101 tokens: one slice at world size 1; at 2 ranks padded to 128 (the last 27 rows of rank
    // 1 padding), masked to -inf in the logits (compared as the largest finite magnitude) and
    // kept out of the loss. Then greedy decoding through the key/value caches.
    check_same_on_gpu([&](Device d) {
      auto make = [&](models::ModelSplit split) {
        Generator g(31);
        split.tensor = dist::world();
        auto model = std::make_shared<models::Llama>(
            models::LlamaOptions{.vocab = 101,
                                 .dim = 32,
                                 .layers = 2,
                                 .block = {.heads = 4, .kv_heads = 2, .qkv_bias = true},
                                 .generator = &g},
            split);
        model->to(kFloat64);
        model->to(d);
        return model;
      };
      Generator pick(32);
      const Tensor tokens = randint(0, 101, {2, 6}, {.dtype = kInt64}, &pick).to(d);
      auto sliced = make({});
      const Tensor logits = (*sliced)(tokens);
      const Tensor loss = parallel::vocab_parallel_cross_entropy(
          logits.reshape({-1, logits.size(-1)}), tokens.reshape({-1}), dist::world());
      loss.backward();
      std::vector<Tensor> out{loss.detach().reshape({1}), clamp(logits.detach(), -1e300, 1e300)};
      for (const Tensor& gr : grads(sliced->parameters())) out.push_back(gr);
      NoGradGuard no_grad;
      auto gathered = make({.gather_logits = true});
      out.push_back(
          nn::generate(*gathered, tokens.narrow(1, 0, 3), {.max_new_tokens = 8}).to(kFloat64));
      return out;
    });
  }

  TEST_CASE("pipelines on CUDA tensors equal the CPU run: GPipe and 1F1B") {
    const int n = dist::world_size(), me = dist::rank();
    for (parallel::Schedule schedule : {parallel::Schedule::GPipe, parallel::Schedule::OneFOneB}) {
      CAPTURE(int(schedule));
      check_same_on_gpu([&](Device d) {
        auto model = mlp(14, d);
        auto stage = parallel::pipeline_stage(*model, me, n);
        parallel::Pipeline pipe(*stage, {.schedule = schedule, .microbatches = 4});
        Tensor x = shared({8, 5}, 24, d), y = shared({8, 3}, 25, d);
        std::vector<Tensor> out;
        for (int step = 0; step < 2; ++step) {
          model->zero_grad();
          Tensor loss = pipe.train_step(
              x, y, [](const Tensor& o, const Tensor& t) { return mse_loss(o, t); });
          if (pipe.is_last()) out.push_back(loss.detach());
        }
        for (const Tensor& gr : grads(model->parameters())) out.push_back(gr);
        Tensor predicted = pipe.predict(x);
        if (pipe.is_last()) out.push_back(predicted);
        return out;
      });
    }
  }

  TEST_CASE("interleaved pipelines and grouped exchanges on CUDA tensors equal the CPU run") {
    const int n = dist::world_size(), me = dist::rank();
    if (n != 2) return;  // two virtual stages per rank: the model's 5 children cut into 2 n
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    check_same_on_gpu([&](Device d) {
      auto model = mlp(15, d);
      auto chunks = parallel::pipeline_chunks(*model, me, n, 2);
      parallel::Pipeline pipe({chunks[0].get(), chunks[1].get()},
                              {.schedule = parallel::Schedule::OneFOneB, .microbatches = 2 * n});
      Tensor x = shared({4 * n, 5}, 26, d), y = shared({4 * n, 3}, 27, d);
      std::vector<Tensor> out;
      Tensor loss =
          pipe.train_step(x, y, [](const Tensor& o, const Tensor& t) { return mse_loss(o, t); });
      if (pipe.is_last()) out.push_back(loss.detach());
      for (const Tensor& gr : grads(model->parameters())) out.push_back(gr);
      Tensor predicted = pipe.predict(x);
      if (pipe.is_last()) out.push_back(predicted);
      for (const Tensor& got : dist::exchange(
               {shared({3, 2}, 30 + uint64_t(me), d), shared({2, 4}, 40 + uint64_t(me), d)},
               {next, prev}, {prev, next}))
        out.push_back(got);
      return out;
    });
  }

  TEST_CASE("activation checkpointing under DDP on CUDA tensors equals the CPU run") {
    check_same_on_gpu([](Device d) {
      manual_seed(15);
      auto block = [] {
        return std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
            std::make_shared<nn::Linear>(8, 8), nn::Tanh()});
      };
      nn::Sequential model{
          std::make_shared<nn::Linear>(5, 8), std::make_shared<nn::Checkpoint>(block()),
          std::make_shared<nn::Checkpoint>(block()), std::make_shared<nn::Linear>(8, 3)};
      model.to(kFloat64);
      model.to(d);
      parallel::DistributedDataParallel ddp(model);
      optim::SGD sgd(model.parameters(), {.lr = 0.1});
      for (int step = 0; step < 2; ++step) {
        sgd.zero_grad();
        auto [x, y] = local_batch(step, d);
        mse_loss(ddp(x), y).backward();
        sgd.step();
      }
      return values(model.parameters());
    });
  }

  TEST_CASE("bf16 autocast with a loss scaler under DDP on CUDA tensors follows the CPU run") {
    // Both sides round to bfloat16 in the same ops; sums may run in another order, so the
    // comparison allows bfloat16's rounding, not float64's.
    check_same_on_gpu(
        [](Device d) {
          auto model = mlp(16, d, kFloat32);
          parallel::DistributedDataParallel ddp(*model);
          optim::SGD sgd(model->parameters(), {.lr = 0.05});
          parallel::GradScaler scaler({.init_scale = 1024});
          std::vector<Tensor> out;
          for (int step = 0; step < 2; ++step) {
            sgd.zero_grad();
            auto [x, y] = local_batch(step, d, kFloat32);
            Tensor loss;
            {
              AutocastGuard autocast(kBFloat16);
              loss = mse_loss(ddp(x), y);
            }
            scaler.scale(loss).backward();
            CHECK(scaler.step(sgd));
            scaler.update();
            out.push_back(loss.detach());
          }
          for (const Tensor& v : values(model->parameters())) out.push_back(v);
          return out;
        },
        2e-2, 2e-3);
  }

  TEST_CASE("ring and all-to-all attention on CUDA tensors equal the CPU run") {
    const int n = dist::world_size();
    const dist::Group world = dist::world();
    using Attention = Tensor (*)(const Tensor&, const Tensor&, const Tensor&, const dist::Group&,
                                 const parallel::ContextParallelOptions&);
    for (Attention attention : {&parallel::ring_attention, &parallel::all_to_all_attention})
      for (auto layout : {parallel::SequenceLayout::Contiguous, parallel::SequenceLayout::ZigZag}) {
        CAPTURE(attention == &parallel::ring_attention);
        CAPTURE(int(layout));
        check_same_on_gpu([&](Device d) {
          const int64_t t = 8 * n;
          auto part = [&](uint64_t seed) {
            return parallel::shard_sequence(shared({2, 2, t, 8}, seed, d), 2, world, layout)
                .contiguous()
                .requires_grad_(true);
          };
          Tensor q = part(31), k = part(32), v = part(33), w = part(34).detach();
          Tensor y = attention(q, k, v, world, {.causal = true, .layout = layout});
          (y * w).sum().backward();
          return std::vector<Tensor>{y.detach(), q.grad().clone(), k.grad().clone(),
                                     v.grad().clone()};
        });
      }
  }

  TEST_CASE("expert-parallel MoE on CUDA tensors equals the CPU run: grouped, looped, biased") {
    const int n = dist::world_size();
    for (double capacity : {0.0, 0.5})
      for (bool gated : {false, true})
        for (bool grouped : {true, false}) {
          CAPTURE(capacity);
          CAPTURE(gated);
          CAPTURE(grouped);
          check_same_on_gpu([&](Device d) {
            nn::MoEOptions options{.hidden = 4,
                                   .ffn = 5,
                                   .router = {.experts = 4 * n,
                                              .top_k = 3,
                                              .capacity_factor = capacity,
                                              .aux_loss_coef = 0.1,
                                              .z_loss_coef = 0.01,
                                              .bias_update_rate = 0.05},
                                   .seed = 11,
                                   .gated = gated,
                                   .shared_ffn = gated ? 3 : 0,
                                   .grouped = grouped};
            options.reduce_shares = parallel::shares_over(dist::world());
            parallel::ExpertParallelMoE moe(options, dist::world());
            moe.to(kFloat64);
            moe.to(d);
            Generator g(41 + uint64_t(dist::rank()));
            Tensor x = randn({7, 4}, {.dtype = kFloat64}, &g).to(d);
            Tensor w = randn({7, 4}, {.dtype = kFloat64}, &g).to(d);
            (void)moe(x);
            nn::update_expert_biases(moe);  // the second forward chooses by the moved bias
            Tensor y = moe(x);
            ((y * w).sum() + moe.aux_loss()).backward();
            std::vector<Tensor> out{y.detach(), moe.aux_loss().detach(),
                                    moe.router().expert_bias()};
            for (const Tensor& gr : grads(moe.parameters())) out.push_back(gr);
            return out;
          });
        }
  }
}

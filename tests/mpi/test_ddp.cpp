// DistributedDataParallel against one process training on the whole (stacked) batch: the
// averaged gradients must equal the single-process gradients of the global mean loss.
#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "helpers.h"
#include "weave/weave.h"

using namespace weave;
using parallel::DistributedDataParallel;

namespace {

constexpr int64_t kLocalBatch = 4;

// An MLP 5 -> 7 -> 6 -> 3 in `dtype`, initialized from `seed`.
std::shared_ptr<nn::Sequential> make_model(uint64_t seed, DType dtype = kFloat64) {
  manual_seed(seed);
  auto model = std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(5, 7), nn::Tanh(), std::make_shared<nn::Linear>(7, 6),
      nn::Tanh(), std::make_shared<nn::Linear>(6, 3)});
  model->to(dtype);
  return model;
}

// Micro-batch m of the global batch: rows of every rank stacked, rank r's at [r*b, (r+1)*b).
std::pair<Tensor, Tensor> global_batch(int micro, DType dtype = kFloat64) {
  Generator g(1234 + uint64_t(micro));
  const int64_t rows = kLocalBatch * dist::world_size();
  return {randn({rows, 5}, {.dtype = dtype}, &g), randn({rows, 3}, {.dtype = dtype}, &g)};
}
Tensor local_rows(const Tensor& t) {
  return t.narrow(0, dist::rank() * kLocalBatch, kLocalBatch);
}

// The single-process reference: gradients of the global mean loss summed over micro-batches.
std::vector<Tensor> reference_grads(const std::vector<int>& micros, DType dtype = kFloat64) {
  auto model = make_model(0, dtype);
  for (int m : micros) {
    auto [x, y] = global_batch(m, dtype);
    mse_loss((*model)(x), y).backward();
  }
  std::vector<Tensor> grads;
  for (const Tensor& p : model->parameters()) grads.push_back(p.grad().clone());
  return grads;
}

void check_grads(nn::Module& model, const std::vector<Tensor>& expected, double rtol, double atol) {
  auto params = model.parameters();
  REQUIRE(params.size() == expected.size());
  for (size_t i = 0; i < params.size(); ++i) {
    CAPTURE(i);
    REQUIRE(params[i].grad().defined());
    CHECK(allclose(params[i].grad(), expected[i], rtol, atol));
  }
}

// Every rank starts from a different model; DDP must broadcast rank 0's.
std::shared_ptr<nn::Sequential> rank_model(DType dtype = kFloat64) {
  return make_model(uint64_t(dist::rank()) * 97, dtype);
}

}  // namespace

TEST_SUITE("ddp") {
  TEST_CASE("DDP gradients equal one process's on the stacked batch, for every bucketing") {
    struct Bucketing {
      const char* name;
      double first_mb, later_mb;
    };
    const double tiny = 1e-9, mixed = 300.0 / (1024 * 1024);  // mixed: ~300 B per bucket
    for (Bucketing b :
         {Bucketing{"one bucket", 100, 100}, Bucketing{"one per parameter", tiny, tiny},
          Bucketing{"mixed", mixed, 2 * mixed}}) {
      for (bool set_to_none : {true, false}) {
        CAPTURE(b.name);
        CAPTURE(set_to_none);
        auto model = rank_model();
        DistributedDataParallel ddp(*model,
                                    {.first_bucket_mb = b.first_mb, .bucket_mb = b.later_mb});
        // The broadcast made every rank's model rank 0's.
        auto start = make_model(0)->parameters();
        for (size_t i = 0; i < start.size(); ++i) CHECK(equal(model->parameters()[i], start[i]));
        for (int step = 0; step < 3; ++step) {  // the first traces the buckets
          CAPTURE(step);
          model->zero_grad(set_to_none);
          auto [x, y] = global_batch(step);
          mse_loss(ddp(local_rows(x)), local_rows(y)).backward();
          check_grads(*model, reference_grads({step}), 1e-12, 1e-14);
        }
        const auto buckets = ddp.bucket_names();
        CHECK(ddp.stats().buckets == int(buckets.size()));
        if (std::string(b.name) == "one bucket") CHECK(buckets.size() == 1);
        if (std::string(b.name) == "one per parameter") CHECK(buckets.size() == 6);
        if (std::string(b.name) == "mixed") CHECK((buckets.size() > 1 && buckets.size() < 6));
        // Buckets follow backward's order: the last layer's gradients come first.
        CHECK(buckets.front().front().rfind("4.", 0) == 0);
      }
    }
  }

  // Side inputs through DDP: every rank's window packs two documents (positions restarting),
  // and the averaged gradients equal one process's on the stacked windows and side inputs.
  TEST_CASE("DDP passes positions and document ids: one process on the stacked batch") {
    const int n = dist::world_size();
    auto build = [] {
      manual_seed(17);
      auto block = std::make_shared<models::LlamaBlock>(
          8, models::LlamaBlockOptions{.heads = 2, .kv_heads = 1, .hidden = 16});
      block->to(kFloat64);
      return block;
    };
    Generator g(71);
    const Tensor x = randn({2 * n, 5, 8}, {.dtype = kFloat64}, &g),
                 target = randn({2 * n, 5, 8}, {.dtype = kFloat64}, &g);
    std::vector<int64_t> positions, documents;  // row r: documents of 1 + r % 3 and the rest
    for (int64_t r = 0; r < 2 * n; ++r)
      for (int64_t i = 0; i < 5; ++i) {
        const int64_t first = 1 + r % 3;
        positions.push_back(i < first ? i : i - first);
        documents.push_back(i < first ? 0 : 1);
      }
    const Tensor all_positions = from_vector(positions, {2 * n, 5}),
                 all_documents = from_vector(documents, {2 * n, 5});
    auto reference = build();
    mse_loss((*reference)({x, all_positions, all_documents}), target).backward();
    auto model = build();
    DistributedDataParallel ddp(*model);
    auto mine = [&](const Tensor& t) { return t.narrow(0, 2 * dist::rank(), 2); };
    mse_loss(ddp({mine(x), mine(all_positions), mine(all_documents)}), mine(target)).backward();
    std::vector<Tensor> expected;
    for (const Tensor& p : reference->parameters()) expected.push_back(p.grad());
    check_grads(*model, expected, 1e-10, 1e-12);
  }

  TEST_CASE("communication starts before backward ends") {
    auto model = rank_model();
    DistributedDataParallel ddp(*model, {.first_bucket_mb = 1e-9, .bucket_mb = 1e-9});
    for (int step = 0; step < 2; ++step) {
      model->zero_grad(false);
      auto [x, y] = global_batch(step);
      mse_loss(ddp(local_rows(x)), local_rows(y)).backward();
    }
    // The first bucket (the last layer's bias) was launched after one gradient of six.
    CHECK(ddp.stats().parameters == 6);
    CHECK(ddp.stats().ready_before_first_launch == 1);
  }

  TEST_CASE("no_sync accumulates three micro-batches, then averages once") {
    auto model = rank_model();
    DistributedDataParallel ddp(*model, {.first_bucket_mb = 1e-4, .bucket_mb = 1e-4});
    for (int round = 0; round < 2; ++round) {  // the first round traces the buckets
      CAPTURE(round);
      model->zero_grad(round == 0);
      for (int micro = 0; micro < 3; ++micro) {
        auto [x, y] = global_batch(10 * round + micro);
        if (micro < 2) {
          auto guard = ddp.no_sync();
          mse_loss(ddp(local_rows(x)), local_rows(y)).backward();
        } else {
          mse_loss(ddp(local_rows(x)), local_rows(y)).backward();
        }
      }
      check_grads(*model, reference_grads({10 * round, 10 * round + 1, 10 * round + 2}), 1e-12,
                  1e-14);
    }
  }

  TEST_CASE("unused parameters: allowed with find_unused_parameters, else named") {
    // The last layer is used on rank 0 only; the middle layer's weight by nobody.
    struct Branchy : nn::Module {
      std::shared_ptr<nn::Linear> a, b, c;
      Branchy() : Module("Branchy") {
        manual_seed(5);
        a = register_module("a", std::make_shared<nn::Linear>(5, 3));
        b = register_module("b", std::make_shared<nn::Linear>(5, 3));
        c = register_module("c", std::make_shared<nn::Linear>(5, 3));
        to(kFloat64);
      }
      Tensor forward(const Tensor& x) override {
        Tensor y = (*a)(x);
        if (dist::rank() == 0) y = y + (*c)(x);
        return y;
      }
    };
    auto [x, y] = global_batch(0);
    {
      Branchy model;
      DistributedDataParallel ddp(model, {.find_unused_parameters = true});
      for (int step = 0; step < 2; ++step) {
        model.zero_grad();
        mse_loss(ddp(local_rows(x)), local_rows(y)).backward();
      }
      // b: nobody's; zero. c: rank 0's gradient averaged with zeros from the others.
      CHECK(equal(model.b->weight.grad(), zeros({3, 5}, {.dtype = kFloat64})));
      Branchy alone;
      Tensor x0 = x.narrow(0, 0, kLocalBatch), y0 = y.narrow(0, 0, kLocalBatch);
      mse_loss((*alone.a)(x0) + (*alone.c)(x0), y0).backward();
      CHECK(allclose(model.c->weight.grad(), alone.c->weight.grad() / double(dist::world_size()),
                     1e-12, 1e-14));
      const auto& unused = ddp.stats().unused;
      CHECK(std::find(unused.begin(), unused.end(), "b.weight") != unused.end());
    }
    {
      Branchy model;
      DistributedDataParallel ddp(model);
      std::string message;
      try {
        mse_loss(ddp(local_rows(x)), local_rows(y)).backward();
      } catch (const Error& e) {
        message = e.what();
      }
      CHECK(message.find("got no gradient") != std::string::npos);
      CHECK(message.find("b.weight") != std::string::npos);
      dist::barrier();  // every rank completed its communication: nobody is left waiting
    }
  }

  TEST_CASE("bf16 compression stays within bfloat16 rounding") {
    auto model = rank_model(kFloat32);
    DistributedDataParallel ddp(*model, {.compress = kBFloat16});
    for (int step = 0; step < 2; ++step) {
      model->zero_grad();
      auto [x, y] = global_batch(step, kFloat32);
      mse_loss(ddp(local_rows(x)), local_rows(y)).backward();
      check_grads(*model, reference_grads({step}, kFloat32), 2e-2, 2e-3);
    }
    CHECK(model->parameters()[0].grad().dtype() == kFloat32);
  }

  TEST_CASE("ranks that disagree on the model raise on every rank") {
    if (dist::world_size() < 2) return;
    manual_seed(0);
    nn::Linear model(4, dist::rank() == 1 ? 5 : 3);
    std::string message;
    try {
      DistributedDataParallel ddp(model);
    } catch (const Error& e) {
      message = e.what();
    }
    CHECK(message.find("ranks disagree on the model") != std::string::npos);
    CHECK(message.find("[5, 4]") != std::string::npos);
  }

  TEST_CASE("broadcast_parameters broadcasts parameters and buffers from a root") {
    auto model = rank_model();
    const int root = dist::world_size() - 1;
    parallel::broadcast_parameters(*model, root);
    auto expected = make_model(uint64_t(root) * 97)->parameters();
    for (size_t i = 0; i < expected.size(); ++i) CHECK(equal(model->parameters()[i], expected[i]));
  }

  TEST_CASE("broadcast_parameters sends only what differs (a checksum agreement)") {
    // Built alike on every rank (1 MB): nothing is packed or sent, so nothing is allocated but
    // the agreement's few bytes.
    manual_seed(7);
    nn::Sequential model({std::make_shared<nn::Linear>(256, 256), nn::Tanh(),
                          std::make_shared<nn::Linear>(256, 256)});
    model.to(kFloat64);
    int64_t before = int64_t(memory_stats().in_use);
    reset_peak_memory();
    parallel::broadcast_parameters(model);
    CHECK(int64_t(memory_stats().peak) - before < 4096);
    // One bias differs on the last rank: it alone travels, and every rank ends with rank 0's.
    Tensor bias = model.parameters()[1];
    const Tensor expected = bias.clone();
    if (dist::world_size() > 1 && dist::rank() == dist::world_size() - 1) {
      NoGradGuard no_grad;
      bias.add_(1.0);
    }
    before = int64_t(memory_stats().in_use);
    reset_peak_memory();
    parallel::broadcast_parameters(model);
    CHECK(equal(bias, expected));
    CHECK(int64_t(memory_stats().peak) - before < 4096 + 3 * 256 * 8);
    CHECK(parallel::check_replicas(model) == (dist::world_size() > 1 ? 4 : 0));
  }

  TEST_CASE("DistributedOptimizer steps like one process on the stacked batch") {
    for (auto compress : {std::optional<DType>(), std::optional<DType>(kFloat32)}) {
      auto model = make_model(0);
      auto reference = make_model(0);
      optim::SGD sgd(model->parameters(), {.lr = 0.1, .momentum = 0.9});
      optim::SGD reference_sgd(reference->parameters(), {.lr = 0.1, .momentum = 0.9});
      // Tiny buckets: several all_reduces in flight at once.
      parallel::DistributedOptimizer optimizer(sgd, {.bucket_mb = 1e-4, .compress = compress});
      for (int step = 0; step < 3; ++step) {
        auto [x, y] = global_batch(step);
        optimizer.zero_grad();
        mse_loss((*model)(local_rows(x)), local_rows(y)).backward();
        optimizer.step();
        reference_sgd.zero_grad();
        mse_loss((*reference)(x), y).backward();
        reference_sgd.step();
      }
      // Exact in float64; compressed to float32 on the wire, within float32 rounding.
      const double rtol = compress ? 1e-5 : 1e-12, atol = compress ? 1e-6 : 1e-14;
      for (size_t i = 0; i < reference->parameters().size(); ++i)
        CHECK(allclose(model->parameters()[i], reference->parameters()[i], rtol, atol));
    }
  }

  TEST_CASE("rank0_first: rank 0 runs first, and its failure reaches every rank") {
    // Rank 0 slowly writes a file that every other rank's call must already find.
    Tensor job = full({1}, double(::getpid()), {.dtype = kInt64});
    dist::broadcast(job, 0);
    const std::filesystem::path file = std::filesystem::temp_directory_path() /
                                       ("weave_rank0_first_" + std::to_string(job.item<int64_t>()));
    bool found = false;
    parallel::rank0_first([&] {
      if (dist::rank() == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        std::ofstream(file) << "prepared";
      }
      found = std::filesystem::exists(file);
    });
    CHECK(found);
    dist::barrier();
    if (dist::rank() == 0) std::filesystem::remove(file);

    std::string message;
    try {
      parallel::rank0_first([] {
        if (dist::rank() == 0) throw Error("[prepare] disk full");
        FAIL("the other ranks must not run fn after rank 0 failed");
      });
    } catch (const Error& e) {
      message = e.what();
    }
    CHECK(message.rfind("[rank0_first]", 0) == 0);
    CHECK(message.find("disk full") != std::string::npos);  // on every rank
  }

  TEST_CASE("ZeRO-1 with Adam equals DDP with Adam, holding 1/N of the state") {
    const int n = dist::world_size();
    auto reference = make_model(0, kFloat32);
    auto model = make_model(0, kFloat32);
    DistributedDataParallel ddp(*reference);
    optim::Adam adam(reference->parameters(), {.lr = 1e-2});
    parallel::ZeroRedundancyOptimizer zero(model->parameters(), [](std::vector<Tensor> shard) {
      return std::make_unique<optim::Adam>(std::move(shard), optim::AdamOptions{.lr = 1e-2});
    });
    for (int step = 0; step < 5; ++step) {
      auto [x, y] = global_batch(step, kFloat32);
      adam.zero_grad();
      mse_loss(ddp(local_rows(x)), local_rows(y)).backward();
      adam.step();
      zero.zero_grad();
      mse_loss((*model)(local_rows(x)), local_rows(y)).backward();
      zero.step();
    }
    for (size_t i = 0; i < reference->parameters().size(); ++i)
      CHECK(allclose(model->parameters()[i], reference->parameters()[i], 1e-6, 1e-7));
    int64_t total = 0, full_state = 0, shard_state = 0;
    for (const Tensor& p : model->parameters()) total += p.numel();
    for (const Tensor& t : adam.state()) full_state += t.numel();
    for (const Tensor& t : zero.shard_optimizer().state()) shard_state += t.numel();
    CHECK(full_state == 2 * total);                   // Adam: two moments per element
    CHECK(shard_state == 2 * ((total + n - 1) / n));  // this rank's slice only
    CHECK(zero.shard_numel() == (total + n - 1) / n);
  }

  TEST_CASE("broadcast_optimizer_state copies the root's state") {
    auto model = make_model(0);
    optim::SGD sgd(model->parameters(), {.lr = 0.1 * (dist::rank() + 1), .momentum = 0.9});
    for (const Tensor& p : model->parameters()) p.set_grad(full_like(p, dist::rank() + 1.0));
    sgd.step();  // momentum buffers = the rank's gradient
    parallel::broadcast_optimizer_state(sgd, 0);
    CHECK(sgd.lr() == doctest::Approx(0.1));
    for (const Tensor& t : sgd.state()) CHECK(allclose(t, full_like(t, 1.0)));
  }

  TEST_CASE("decentralized 'complete' equals DDP step for step (SGD), also accumulating") {
    auto sgd_factory = [](std::vector<Tensor> bucket) {
      return std::make_unique<optim::SGD>(std::move(bucket), optim::SGDOptions{.lr = 0.1});
    };
    auto model = rank_model(), reference = rank_model();
    parallel::DecentralizedDataParallel dec(
        *model, sgd_factory, {.topology = "complete", .first_bucket_mb = 1e-4, .bucket_mb = 1e-4});
    DistributedDataParallel ddp(*reference);
    optim::SGD sgd(reference->parameters(), {.lr = 0.1});
    for (int step = 0; step < 4; ++step) {
      CAPTURE(step);
      auto [x, y] = global_batch(step);
      auto [x2, y2] = global_batch(100 + step);
      const bool accumulate = step == 3;  // the last step accumulates two micro-batches
      if (accumulate) {
        dec.set_accumulate_grad(true);
        mse_loss(dec(local_rows(x2)), local_rows(y2)).backward();
        dec.set_accumulate_grad(false);
      }
      mse_loss(dec(local_rows(x)), local_rows(y)).backward();
      sgd.zero_grad();
      if (accumulate) {
        auto guard = ddp.no_sync();
        mse_loss(ddp(local_rows(x2)), local_rows(y2)).backward();
      }
      mse_loss(ddp(local_rows(x)), local_rows(y)).backward();
      sgd.step();
      dec.wait();
      for (size_t i = 0; i < reference->parameters().size(); ++i)
        CHECK(allclose(model->parameters()[i], reference->parameters()[i], 1e-12, 1e-14));
    }
    CHECK(dec.steps() == 4);
  }

  TEST_CASE("decentralized 'complete' on a 2x2 mesh's data group equals DDP on that group") {
    if (dist::world_size() != 4) return;
    parallel::ProcessMesh mesh({.data = 2, .tensor = 2});
    // The two data groups ({0, 2} and {1, 3}) train different models: mixing across them, or
    // averaging over the world, would pull each toward the other.
    const uint64_t seed = 11 + uint64_t(mesh.tensor_rank()) * 5;
    auto model = make_model(seed), reference = make_model(seed);
    for (const Tensor& p : model->parameters()) p.detach().add_(double(mesh.data_rank()));
    CHECK_WEAVE_ERROR(parallel::DecentralizedDataParallel(*model,
                                                          [](std::vector<Tensor> bucket) {
                                                            return std::make_unique<optim::SGD>(
                                                                std::move(bucket),
                                                                optim::SGDOptions{.lr = 0.1});
                                                          },
                                                          {.topology = "complete"}),
                      "DecentralizedDataParallel", "mesh.data()");
    parallel::DecentralizedDataParallel dec(*model,
                                            [](std::vector<Tensor> bucket) {
                                              return std::make_unique<optim::SGD>(
                                                  std::move(bucket), optim::SGDOptions{.lr = 0.1});
                                            },
                                            {.topology = "complete", .group = mesh.data()});
    DistributedDataParallel ddp(*reference, {.group = mesh.data()});
    optim::SGD sgd(reference->parameters(), {.lr = 0.1});
    for (int step = 0; step < 3; ++step) {
      CAPTURE(step);
      auto [x, y] = global_batch(step + 10 * mesh.tensor_rank());
      Tensor xs = x.narrow(0, mesh.data_rank() * kLocalBatch, kLocalBatch);
      Tensor ys = y.narrow(0, mesh.data_rank() * kLocalBatch, kLocalBatch);
      mse_loss(dec(xs), ys).backward();
      sgd.zero_grad();
      mse_loss(ddp(xs), ys).backward();
      sgd.step();
      dec.wait();
      for (size_t i = 0; i < reference->parameters().size(); ++i)
        CHECK(allclose(model->parameters()[i], reference->parameters()[i], 1e-12, 1e-14));
    }
    CHECK(dec.group().ranks() == mesh.data().ranks());
  }

  TEST_CASE("decentralized ring and one-peer-exp mix exactly with their neighbours") {
    const int n = dist::world_size(), me = dist::rank();
    for (std::string topology : {"ring", "one-peer-exp"}) {
      CAPTURE(topology);
      if (topology == "ring" && n % 2 != 0) {
        CHECK_THROWS_AS(parallel::topology_phases(topology, n), Error);
        continue;
      }
      if (topology == "one-peer-exp" && (n < 2 || (n & (n - 1)) != 0)) continue;
      auto model = rank_model();
      const double lr = 0.05;
      parallel::DecentralizedDataParallel dec(*model,
                                              [lr](std::vector<Tensor> bucket) {
                                                return std::make_unique<optim::SGD>(
                                                    std::move(bucket), optim::SGDOptions{.lr = lr});
                                              },
                                              {.topology = topology});
      // Two steps by hand: every rank's local step from the common start, then each phase's
      // mixing matrix applied.
      auto start = make_model(0);
      std::vector<std::vector<Tensor>> replicas(static_cast<size_t>(n));
      for (int r = 0; r < n; ++r)
        for (const Tensor& p : start->parameters()) replicas[size_t(r)].push_back(p.clone());
      for (int step = 0; step < 2; ++step) {
        auto [x, y] = global_batch(step);
        mse_loss(dec(local_rows(x)), local_rows(y)).backward();
        std::vector<std::vector<Tensor>> stepped(static_cast<size_t>(n));
        for (int r = 0; r < n; ++r) {
          auto local = make_model(0);
          for (size_t i = 0; i < local->parameters().size(); ++i)
            local->parameters()[i].detach().copy_(replicas[size_t(r)][i]);
          mse_loss((*local)(x.narrow(0, r * kLocalBatch, kLocalBatch)),
                   y.narrow(0, r * kLocalBatch, kLocalBatch))
              .backward();
          for (const Tensor& p : local->parameters())
            stepped[size_t(r)].push_back(p.detach() - p.grad() * lr);
        }
        auto m = parallel::mixing_matrix(dec.phases()[size_t(step) % dec.phases().size()], n);
        for (int r = 0; r < n; ++r)
          for (size_t i = 0; i < replicas[size_t(r)].size(); ++i) {
            Tensor mixed = zeros_like(stepped[0][i]);
            for (int j = 0; j < n; ++j)
              mixed = mixed + stepped[size_t(j)][i] * m[size_t(r)][size_t(j)];
            replicas[size_t(r)][i] = mixed;
          }
      }
      dec.wait();
      for (size_t i = 0; i < replicas[size_t(me)].size(); ++i)
        CHECK(allclose(model->parameters()[i], replicas[size_t(me)][i], 1e-12, 1e-14));
      // global_avg: every rank ends with the mean of the replicas.
      dec.global_avg();
      for (size_t i = 0; i < replicas[0].size(); ++i) {
        Tensor mean = zeros_like(replicas[0][i]);
        for (int r = 0; r < n; ++r) mean = mean + replicas[size_t(r)][i] / double(n);
        CHECK(allclose(model->parameters()[i], mean, 1e-12, 1e-14));
      }
    }
  }
}

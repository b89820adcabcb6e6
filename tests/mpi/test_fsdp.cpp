// FullyShardedDataParallel against DistributedDataParallel (itself checked against one process
// on the stacked batch): after 20 AdamW steps the whole parameters must agree to 1e-10 in
// float64, for ZeRO-2 and ZeRO-3, uneven units, tied and unused parameters, no_sync
// accumulation, activation checkpointing and tensor-parallel blocks inside. Plus the memory
// bound, the prefetch order in the trace, and the errors.
#include <doctest/doctest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include <unistd.h>

#include "fsdp_helpers.h"
#include "helpers.h"
#include "weave/weave.h"

using namespace weave;
using parallel::DistributedDataParallel;
using parallel::FullyShardedDataParallel;

using namespace weave::test::fsdp;

namespace {

// A 6 -> 6 -> 6 -> 5 model whose second and third layers share one weight (they land in the
// root unit), and a layer that forward never calls.
struct TiedModel : nn::Module {
  std::shared_ptr<nn::Linear> a, b, c, unused;
  TiedModel() {
    a = register_module("a", std::make_shared<nn::Linear>(5, 6));
    b = register_module("b", std::make_shared<nn::Linear>(6, 6));
    c = register_module("c", std::make_shared<nn::Linear>(6, 6));
    unused = register_module("unused", std::make_shared<nn::Linear>(4, 4));
    to(kFloat64);
    c->weight = b->weight;
  }
  Tensor forward(const Tensor& x) override {
    return (*c)(tanh((*b)(tanh((*a)(x))))).narrow(1, 0, 3);
  }
};

}  // namespace

TEST_SUITE("fsdp") {
  TEST_CASE("DDP and FSDP through one DataParallelWrapper face train, save and decode alike") {
    // A trainer holding either wrapper by its face: parameter groups, forward, the module that
    // checkpoints read, whole state and decoding. Both must train the same model (1e-10).
    auto reference = make_model(41), model = make_model(41);
    std::vector<std::unique_ptr<parallel::DataParallelWrapper>> wrappers;
    wrappers.push_back(std::make_unique<DistributedDataParallel>(*reference));
    wrappers.push_back(std::make_unique<FullyShardedDataParallel>(*model));
    std::vector<std::unique_ptr<optim::AdamW>> optimizers;
    for (auto& w : wrappers)
      optimizers.push_back(std::make_unique<optim::AdamW>(
          w->param_groups(optim::weight_decay_groups(w->module(), 0.05)), adamw_options()));
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = local_batch(step);
      for (size_t i = 0; i < wrappers.size(); ++i) {
        optimizers[i]->zero_grad();
        mse_loss(wrappers[i]->forward(x), y).backward();
        optimizers[i]->step();
      }
    }
    const nn::NamedTensors ddp_state = wrappers[0]->full_state_dict();
    const nn::NamedTensors fsdp_state = wrappers[1]->full_state_dict();
    REQUIRE(ddp_state.size() == fsdp_state.size());
    for (size_t i = 0; i < ddp_state.size(); ++i) {
      CAPTURE(ddp_state[i].first);
      CHECK(ddp_state[i].first == fsdp_state[i].first);
      CHECK(weave::abs(ddp_state[i].second - fsdp_state[i].second).max().item<double>() < 1e-10);
    }
    // What a checkpoint reads: DDP's module itself, FSDP's shards (what the optimizer steps).
    CHECK(&wrappers[0]->sharded_module() == reference.get());
    const auto shards = wrappers[1]->sharded_module().parameters();
    const auto trained = wrappers[1]->trained_parameters();
    REQUIRE(shards.size() == trained.size());
    for (size_t i = 0; i < shards.size(); ++i) CHECK(shards[i].impl() == trained[i].impl());
    // Decoding inside run(): gradients off, the whole parameters in place, the same outputs.
    const Tensor probe = local_batch(9).first;
    Tensor outputs[2];
    for (size_t i = 0; i < wrappers.size(); ++i)
      wrappers[i]->run([&] {
        CHECK_FALSE(autograd::GradMode::is_enabled());
        outputs[i] = wrappers[i]->module()(probe);
      });
    CHECK(autograd::GradMode::is_enabled());
    CHECK(weave::abs(outputs[0] - outputs[1]).max().item<double>() < 1e-10);
  }

  TEST_CASE("ZeRO-3 and ZeRO-2 equal DDP after 20 AdamW steps, with no_sync accumulation") {
    for (auto sharding :
         {parallel::ShardingStrategy::FullShard, parallel::ShardingStrategy::ShardGradOp}) {
      for (bool prefetch : {true, false}) {
        CAPTURE(int(sharding));
        CAPTURE(prefetch);
        // Rank 0's model is broadcast: the reference is that model on every rank.
        auto reference = make_model(100), model = make_model(100 + uint64_t(dist::rank()));
        DistributedDataParallel ddp(*reference);
        optim::AdamW reference_opt(reference->parameters(), adamw_options());
        FullyShardedDataParallel fsdp(*model, {.sharding = sharding, .prefetch = prefetch});
        CHECK(fsdp.unit_names() == std::vector<std::string>{"0", "2", "4"});
        CHECK(fsdp.shard_names() ==
              std::vector<std::string>{"unit0_float64", "unit1_float64", "unit2_float64"});
        optim::AdamW opt(fsdp.parameters(), adamw_options());
        // The shards: 1/N of each unit, padded.
        const int n = dist::world_size();
        int64_t shard_elements = 0;
        for (const Tensor& s : fsdp.parameters()) shard_elements += s.numel();
        CHECK(shard_elements == (96 + n - 1) / n + (153 + n - 1) / n + (30 + n - 1) / n);
        // Rank 0's model was broadcast: the first whole state equals the reference's.
        CHECK(max_difference(*reference, fsdp) == 0);
        for (int step = 0; step < 20; ++step) {
          CAPTURE(step);
          auto [x, y] = local_batch(step);
          reference_opt.zero_grad();
          opt.zero_grad();
          if (step % 5 == 4) {  // two micro-batches accumulated, then one averaging backward
            auto [x2, y2] = local_batch(1000 + step);
            {
              auto guard = ddp.no_sync();
              mse_loss(ddp(x2), y2).backward();
            }
            auto guard = fsdp.no_sync();
            mse_loss(fsdp(x2), y2).backward();
          }
          mse_loss(ddp(x), y).backward();
          mse_loss(fsdp(x), y).backward();
          reference_opt.step();
          opt.step();
        }
        CHECK(max_difference(*reference, fsdp) <= 1e-10);
        CHECK(fsdp.stats().steps == 20);
        if (prefetch && n > 1) CHECK(fsdp.stats().prefetches > 0);
        if (!prefetch) CHECK(fsdp.stats().prefetches == 0);
      }
    }
  }

  TEST_CASE(
      "a parameter shared between units goes to the root unit; unused parameters reduce zeros") {
    manual_seed(21);
    auto reference = std::make_shared<TiedModel>();
    manual_seed(21);
    auto model = std::make_shared<TiedModel>();
    CHECK(model->parameters().size() == 7);  // c.weight is b.weight: listed once
    DistributedDataParallel ddp(*reference, {.find_unused_parameters = true});
    optim::AdamW reference_opt(reference->parameters(), adamw_options());
    FullyShardedDataParallel fsdp(*model);
    // b and c keep only their biases; the shared weight is the root's.
    CHECK(fsdp.unit_names() == std::vector<std::string>{"a", "b", "c", "unused", ""});
    optim::AdamW opt(fsdp.parameters(), adamw_options());
    train_side_by_side(ddp, reference_opt, fsdp, opt, 20);
    CHECK(max_difference(*reference, fsdp) <= 1e-10);
  }

  TEST_CASE("checkpointed units equal plain ones bitwise, and DDP") {
    const auto build = [](uint64_t seed) {
      manual_seed(seed);
      auto model =
          std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
              std::make_shared<nn::Linear>(5, 12),
              std::make_shared<nn::Checkpoint>(std::make_shared<nn::Sequential>(
                  std::initializer_list<std::shared_ptr<nn::Module>>{
                      std::make_shared<nn::Linear>(12, 12), nn::Tanh(),
                      std::make_shared<nn::Dropout>(0.2)})),
              std::make_shared<nn::Checkpoint>(std::make_shared<nn::Linear>(12, 3))});
      model->to(kFloat64);
      return model;
    };
    auto reference = build(5), model = build(5);
    DistributedDataParallel ddp(*reference);
    optim::AdamW reference_opt(reference->parameters(), adamw_options());
    FullyShardedDataParallel fsdp(*model);
    optim::AdamW opt(fsdp.parameters(), adamw_options());
    for (int step = 0; step < 6; ++step) {
      auto [x, y] = local_batch(step);
      reference_opt.zero_grad();
      opt.zero_grad();
      const Generator saved = default_generator();
      mse_loss(ddp(x), y).backward();
      default_generator() = saved;  // the same dropout masks in both
      mse_loss(fsdp(x), y).backward();
      reference_opt.step();
      opt.step();
    }
    CHECK(max_difference(*reference, fsdp) <= 1e-10);
  }

  // A packed window's positions and document ids reach every block through FSDP's units (their
  // gathers are forward hooks, which pass the side inputs by) as through DDP.
  TEST_CASE("Llama blocks with positions and document ids: FSDP equals DDP") {
    const auto build = [](uint64_t seed) {
      manual_seed(seed);
      const models::LlamaBlockOptions options{.heads = 2, .kv_heads = 1, .hidden = 16};
      auto model =
          std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
              std::make_shared<models::LlamaBlock>(8, options),
              std::make_shared<nn::Checkpoint>(std::make_shared<models::LlamaBlock>(8, options))});
      model->to(kFloat64);
      return model;
    };
    auto reference = build(7), model = build(7);
    DistributedDataParallel ddp(*reference);
    optim::AdamW reference_opt(reference->parameters(), adamw_options());
    FullyShardedDataParallel fsdp(*model);
    optim::AdamW opt(fsdp.parameters(), adamw_options());
    const Tensor positions = from_vector<int64_t>({0, 1, 0, 1, 2, 3}, {6});
    const Tensor documents = from_vector<int64_t>({0, 0, 1, 1, 1, 1}, {6});
    for (int step = 0; step < 4; ++step) {
      Generator g(300 + uint64_t(step) * 10 + uint64_t(dist::rank()));
      const Tensor x = randn({2, 6, 8}, {.dtype = kFloat64}, &g);
      const Tensor target = randn({2, 6, 8}, {.dtype = kFloat64}, &g);
      reference_opt.zero_grad();
      opt.zero_grad();
      mse_loss(ddp({x, positions, documents}), target).backward();
      mse_loss(fsdp({x, positions, documents}), target).backward();
      reference_opt.step();
      opt.step();
    }
    CHECK(max_difference(*reference, fsdp) <= 1e-10);
  }

  TEST_CASE("a library model's units are its blocks by default, and it trains as under DDP") {
    const auto build = [](uint64_t seed) {
      manual_seed(seed);
      auto model = std::make_shared<models::Llama>(models::LlamaOptions{
          .vocab = 16, .dim = 8, .layers = 3, .block = {.heads = 2, .kv_heads = 1, .hidden = 16}});
      model->to(kFloat64);
      return model;
    };
    auto reference = build(8), model = build(8);
    DistributedDataParallel ddp(*reference);
    optim::AdamW reference_opt(reference->parameters(), adamw_options());
    FullyShardedDataParallel fsdp(*model);
    // One shard per unit: the embedding, each of the 3 blocks, the final norm, the head.
    CHECK(fsdp.parameters().size() == 6);
    CHECK(fsdp.shard_names().size() == 6);
    optim::AdamW opt(fsdp.parameters(), adamw_options());
    for (int step = 0; step < 3; ++step) {
      Generator g(400 + uint64_t(step) * 10 + uint64_t(dist::rank()));
      const Tensor tokens = randint(0, 16, {2, 7}, {.dtype = kInt64}, &g);
      const Tensor targets = randint(0, 16, {14}, {.dtype = kInt64}, &g);
      reference_opt.zero_grad();
      opt.zero_grad();
      cross_entropy(ddp(tokens).reshape({14, 16}), targets).backward();
      cross_entropy(fsdp(tokens).reshape({14, 16}), targets).backward();
      reference_opt.step();
      opt.step();
    }
    CHECK(max_difference(*reference, fsdp) <= 1e-10);
  }

  TEST_CASE("bfloat16 parameters, and a unit holding two dtypes, equal DDP") {
    // bfloat16 layers, then a float32 head: grouped into one unit (unit_mb) or one unit each.
    struct Mixed : nn::Module {
      std::shared_ptr<nn::Sequential> low;
      std::shared_ptr<nn::Linear> high;
      explicit Mixed(uint64_t seed) {
        manual_seed(seed);
        low = register_module("low", std::make_shared<nn::Sequential>(
                                         std::initializer_list<std::shared_ptr<nn::Module>>{
                                             std::make_shared<nn::Linear>(5, 16), nn::Tanh(),
                                             std::make_shared<nn::Linear>(16, 9)}));
        high = register_module("high", std::make_shared<nn::Linear>(9, 3));
        low->to(kBFloat16);
      }
      Tensor forward(const Tensor& x) override {
        return (*high)(tanh((*low)(x.to(kBFloat16))).to(kFloat32));
      }
    };
    for (double unit_mb : {0.0, 1.0}) {
      CAPTURE(unit_mb);
      auto reference = std::make_shared<Mixed>(3), model = std::make_shared<Mixed>(3);
      DistributedDataParallel ddp(*reference);
      optim::AdamW reference_opt(reference->parameters(), adamw_options());
      FullyShardedDataParallel fsdp(*model, {.unit_mb = unit_mb});
      const auto expected_shards =
          unit_mb > 0 ? std::vector<std::string>{"unit0_bfloat16", "unit0_float32"}
                      : std::vector<std::string>{"unit0_bfloat16", "unit1_float32"};
      CHECK(fsdp.shard_names() == expected_shards);
      CHECK(fsdp.parameters()[0].dtype() == kBFloat16);
      optim::AdamW opt(fsdp.parameters(), adamw_options());
      const Tensor initial = reference->low->parameters()[0].detach().clone();
      for (int step = 0; step < 10; ++step) {
        auto [x, y] = local_batch(step);
        reference_opt.zero_grad();
        opt.zero_grad();
        mse_loss(ddp(x), y.to(kFloat32)).backward();
        mse_loss(fsdp(x), y.to(kFloat32)).backward();
        reference_opt.step();
        opt.step();
      }
      // The reduction's rounding to bfloat16 is the same as DDP's: the same sums in float32,
      // rounded once.
      CHECK(max_difference(*reference, fsdp) == 0);
      // bfloat16's steps are coarse: the test means something only if the weights moved.
      CHECK(weave::abs(reference->low->parameters()[0].detach() - initial).max().item<double>() >
            0.01);
    }
  }

  TEST_CASE("tensor-parallel blocks inside, on a 2x2 mesh: FSDP over mesh.data() equals DDP") {
    if (dist::world_size() != 4) return;
    parallel::ProcessMesh mesh({.data = 2, .tensor = 2});
    const int64_t dim = 8, heads = 4, t = 4, b = 2;
    auto build = [&] {
      manual_seed(5 + uint64_t(dist::rank()));  // each tensor rank's shards; data rank 0's win
      auto model = std::make_shared<nn::Sequential>();
      for (int l = 0; l < 2; ++l)
        model->push_back(std::make_shared<nn::TransformerBlock>(
            dim, heads, nn::TransformerBlockOptions{.hidden = 16},
            nn::Leaves{.linears = parallel::tensor_parallel(mesh.tensor())}));
      model->to(kFloat64);
      return model;
    };
    auto reference = build(), model = build();
    DistributedDataParallel ddp(*reference, {.group = mesh.data()});
    optim::AdamW reference_opt(reference->parameters(), adamw_options());
    FullyShardedDataParallel fsdp(*model, {.group = mesh.data()});
    optim::AdamW opt(fsdp.parameters(), adamw_options());
    for (int step = 0; step < 5; ++step) {
      Generator g(300 + uint64_t(step) * 10 + uint64_t(mesh.data_rank()));  // per data rank
      Tensor x = randn({t, b, dim}, {.dtype = kFloat64}, &g);
      reference_opt.zero_grad();
      opt.zero_grad();
      // One model's forward and backward, then the other's: the engine runs the collectives
      // a forward recorded (the tensor-parallel ones) in the next backward, whichever graph
      // that backward is for.
      Tensor a = ddp(x);
      mean(a * a).backward();
      Tensor c = fsdp(x);
      mean(c * c).backward();
      reference_opt.step();
      opt.step();
    }
    CHECK(max_difference(*reference, fsdp) <= 1e-10);
  }

  TEST_CASE("the trace shows unit 1's all_gather starting while unit 0's forward runs") {
    if (dist::world_size() < 2) return;
    // Unit 0 takes 100 ms (a layer that sleeps), so the prefetched gather has time to start.
    struct Slow : nn::Module {
      std::shared_ptr<nn::Linear> fc;
      Slow() { fc = register_module("fc", std::make_shared<nn::Linear>(5, 16)); }
      Tensor forward(const Tensor& x) override {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        return (*fc)(x);
      }
    };
    for (bool prefetch : {true, false}) {
      CAPTURE(prefetch);
      manual_seed(4);
      auto model =
          std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
              std::make_shared<Slow>(), nn::Tanh(), std::make_shared<nn::Linear>(16, 9)});
      model->to(kFloat64);
      FullyShardedDataParallel fsdp(*model, {.prefetch = prefetch});
      auto [x, y] = local_batch(0, 5, 9);
      mse_loss(fsdp(x), y).backward();  // the first step learns the forward order
      trace::start((std::filesystem::temp_directory_path() /
                    fmt::format("weave_fsdp_trace_{}_{{rank}}.json", getpid()))
                       .string());
      fsdp(x);
      const std::string path = trace::stop();
      nlohmann::json events = nlohmann::json::parse(std::ifstream(path))["traceEvents"];
      std::filesystem::remove(path);
      // Unit 1's shard: 153 elements over N ranks, float64.
      const int64_t n = dist::world_size(), unit1_bytes = (153 + n - 1) / n * 8;
      double unit0_start = -1, unit0_end = -1, gather1_start = -1;
      for (const auto& e : events) {
        if (e["ph"] != "X") continue;
        if (e["cat"] == "fsdp" && e["name"] == "forward unit 0") {
          unit0_start = e["ts"].get<double>();
          unit0_end = unit0_start + e["dur"].get<double>();
        }
        if (e["cat"] == "collective" && e["name"] == "all_gather" &&
            e["args"]["bytes"].get<int64_t>() == unit1_bytes)
          gather1_start = e["ts"].get<double>();
      }
      REQUIRE(unit0_start >= 0);
      REQUIRE(gather1_start >= 0);
      if (prefetch)
        CHECK(gather1_start < unit0_end);  // in flight while unit 0 computes
      else
        CHECK(gather1_start >= unit0_end);  // only when unit 1's own forward begins
    }
  }

  TEST_CASE("ZeRO-3 holds 1/N of the state plus the units in flight") {
    const int n = dist::world_size();
    const int64_t width = 192;
    const int layers = 6;
    auto measure = [&](bool sharded) {
      cpu_empty_cache();
      const size_t before = memory_stats().in_use;
      auto model = std::make_shared<nn::Sequential>();
      manual_seed(9);
      for (int l = 0; l < layers; ++l) model->push_back(std::make_shared<nn::Linear>(width, width));
      model->to(kFloat64);
      std::unique_ptr<FullyShardedDataParallel> fsdp;
      std::unique_ptr<DistributedDataParallel> ddp;
      std::unique_ptr<optim::AdamW> opt;
      if (sharded) {
        fsdp = std::make_unique<FullyShardedDataParallel>(*model);
        opt = std::make_unique<optim::AdamW>(fsdp->parameters(), adamw_options());
      } else {
        ddp = std::make_unique<DistributedDataParallel>(*model);
        opt = std::make_unique<optim::AdamW>(model->parameters(), adamw_options());
      }
      size_t peak = 0;
      for (int step = 0; step < 3; ++step) {
        auto [x, y] = local_batch(step, width, width);
        reset_peak_memory();
        opt->zero_grad();
        Tensor out = sharded ? (*fsdp)(x) : (*ddp)(x);
        mse_loss(out, y).backward();
        opt->step();
        peak = memory_stats().peak - before;
      }
      return peak;
    };
    const double unit = double(width * width + width) * 8;
    const double state = 4 * layers * unit;  // parameters, gradients, two Adam moments
    const size_t ddp_peak = measure(false), fsdp_peak = measure(true);
    // In flight during backward: two units' gathered parameters (the one running and the one
    // prefetched), three units of whole gradients (the unit's accumulating buffer, the previous
    // unit's while its reduce_scatter completes, and the fresh weight gradient before it is
    // accumulated), and activations (4 rows per layer, a few copies: under a quarter unit).
    const double bound = state / n + 2 * unit + 3 * unit + 0.25 * unit;
    MESSAGE("DDP peak " << ddp_peak << " B, ZeRO-3 peak " << fsdp_peak << " B, bound " << bound
                        << " B at " << n << " ranks");
    CHECK(double(fsdp_peak) <= bound);
    CHECK(double(ddp_peak) >= state);
    if (n >= 2) CHECK(double(fsdp_peak) < 0.75 * double(ddp_peak));
  }

  TEST_CASE("parameter groups through FSDP and a resharded resume equal one process") {
    constexpr int kSteps = 6, kSaved = 3;
    auto reference = make_model(21);
    optim::AdamW want(optim::weight_decay_groups(*reference, 0.2), adamw_options());
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = global_batch(step);
      want.zero_grad();
      mse_loss(reference->forward(x), y).backward();
      want.step();
    }
    for (auto sharding :
         {parallel::ShardingStrategy::FullShard, parallel::ShardingStrategy::ShardGradOp}) {
      CAPTURE(int(sharding));
      const std::string dir = test::shared_dir("fsdp_groups");
      {
        auto model = make_model(21);
        FullyShardedDataParallel fsdp(*model, {.sharding = sharding});
        optim::AdamW adamw(fsdp.param_groups(optim::weight_decay_groups(*model, 0.2)),
                           adamw_options());
        for (int step = 0; step < kSaved; ++step) {
          auto [x, y] = local_batch(step);
          adamw.zero_grad();
          mse_loss(fsdp(x), y).backward();
          adamw.step();
        }
        data::TrainingState state{.model = &fsdp.sharded_module(), .optimizer = &adamw};
        parallel::save_sharded_checkpoint(dir, state);
      }
      // Every rank resumes alone, without FSDP, with the groups of the plain model.
      auto model = make_model(99);
      optim::AdamW adamw(optim::weight_decay_groups(*model, 0.2), adamw_options());
      data::TrainingState state{.model = model.get(), .optimizer = &adamw};
      parallel::load_sharded_checkpoint(dir, state);
      for (int step = kSaved; step < kSteps; ++step) {
        auto [x, y] = global_batch(step);
        adamw.zero_grad();
        mse_loss(model->forward(x), y).backward();
        adamw.step();
      }
      test::check_params(*model, reference->parameters());
      dist::barrier();
      if (dist::rank() == 0) std::filesystem::remove_all(dir);
    }
    // The groups must cover the model, once each.
    auto model = make_model(1);
    FullyShardedDataParallel fsdp(*model);
    auto groups = optim::weight_decay_groups(*model, 0.2);
    groups.pop_back();
    CHECK_WEAVE_ERROR(fsdp.param_groups(groups), "FullyShardedDataParallel.param_groups",
                      "is in no group");
    // An optimizer over the model's own parameters would step nothing (FSDP released them and
    // trains its shards): it raises at its first step, naming what to step instead.
    optim::AdamW released(optim::weight_decay_groups(*model, 0.2), adamw_options());
    auto [x, y] = local_batch(0);
    mse_loss(fsdp(x), y).backward();
    CHECK_WEAVE_ERROR(released.step(), "optimizer step", "fsdp.param_groups(groups)");
    optim::AdamW shards(fsdp.param_groups(optim::weight_decay_groups(*model, 0.2)),
                        adamw_options());
    shards.step();  // the shards take the step
  }

  TEST_CASE("ZeRO-1 with parameter groups equals one process with them") {
    auto reference = make_model(22), model = make_model(22);
    optim::AdamW want(optim::weight_decay_groups(*reference, 0.2), adamw_options());
    parallel::ZeroRedundancyOptimizer zero(
        optim::weight_decay_groups(*model, 0.2), [](std::vector<optim::ParamGroup> groups) {
          return std::make_unique<optim::AdamW>(groups, adamw_options());
        });
    for (int step = 0; step < 5; ++step) {
      auto [gx, gy] = global_batch(step);
      want.zero_grad();
      mse_loss(reference->forward(gx), gy).backward();
      want.step();
      auto [x, y] = local_batch(step);
      zero.zero_grad();
      mse_loss(model->forward(x), y).backward();
      zero.step();
    }
    test::check_params(*model, reference->parameters());
  }
}

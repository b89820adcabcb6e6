// Pipeline parallelism against one process: GPipe, 1F1B and interleaved schedules give the
// whole batch's gradients; GPT-2's stages, its embedding tied to the last stage's head, train as
// one process; the bubble is what theory says; communication left pending and
// forgotten backward passes are errors on every rank; isend does not deadlock.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <thread>
#include <vector>

#include "model_parallel_helpers.h"
#include "weave/weave.h"

using namespace weave;
using namespace weave_test;
using autograd::FunctionContext;

namespace {

// 5 -> w -> w -> w -> 3 with tanh between: seven children to cut into stages.
std::shared_ptr<nn::Sequential> pipeline_model(int64_t width) {
  manual_seed(3);
  auto model = std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(5, width), nn::Tanh(),
      std::make_shared<nn::Linear>(width, width), nn::Tanh(),
      std::make_shared<nn::Linear>(width, width), nn::Tanh(),
      std::make_shared<nn::Linear>(width, 3)});
  model->to(kFloat64);
  return model;
}

// A pipeline's stages together hold every gradient of the whole model, each on exactly one
// rank, equal to the reference's.
void check_stage_grads(const nn::Module& model, const nn::Module& reference) {
  const auto params = model.parameters(), expected = reference.parameters();
  int64_t mine = 0;
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].grad().defined()) {
      ++mine;
      CHECK(close(params[i].grad(), expected[i].grad()));
    }
  Tensor count = full({1}, double(mine), {.dtype = kInt64});
  dist::all_reduce(count);
  CHECK(count.item<int64_t>() == int64_t(params.size()));
}

// A stage of fixed duration: sleeps in forward and twice as long in backward.
constexpr auto kForwardDelay = std::chrono::milliseconds(40);
struct Delay : autograd::Function<Delay> {
  static constexpr const char* name = "DelayBackward";
  static Tensor forward(FunctionContext&, const Tensor& x) {
    std::this_thread::sleep_for(kForwardDelay);
    return x * 1.0;
  }
  static std::vector<Tensor> backward(FunctionContext&, const std::vector<Tensor>& grads) {
    std::this_thread::sleep_for(2 * kForwardDelay);
    return {grads[0]};
  }
};
class DelayStage : public nn::Module {
 public:
  DelayStage() : nn::Module("DelayStage"), scale(register_parameter("scale", ones({1}))) {}
  Tensor forward(const Tensor& x) override { return Delay::apply(x * scale); }
  Tensor& scale;
};

}  // namespace

TEST_SUITE("pipeline") {
  TEST_CASE("GPipe and 1F1B give one process's gradients on the whole batch") {
    const int n = dist::world_size(), me = dist::rank();
    for (parallel::Schedule schedule : {parallel::Schedule::GPipe, parallel::Schedule::OneFOneB})
      for (int m : {1, 4, 8})
        for (int64_t width : {int64_t{8}, int64_t{1024}}) {
          if (width > 8 && m != 4) continue;  // large messages: one case is enough
          CAPTURE(int(schedule));
          CAPTURE(m);
          CAPTURE(width);
          auto model = pipeline_model(width);
          auto stage = parallel::pipeline_stage(*model, me, n);
          parallel::Pipeline pipe(*stage, {.schedule = schedule, .microbatches = m});
          // 64 KB activations per micro-batch in the large case (8 rows of 1024 doubles)
          const int64_t batch = width > 8 ? 8 * m : 8;
          Tensor x = shared_randn({batch, 5}, 31), y = shared_randn({batch, 3}, 32);
          for (int step = 0; step < 2; ++step) {  // twice: nothing left over between steps
            model->zero_grad();
            Tensor loss = pipe.train_step(x, y, mse);
            auto reference = pipeline_model(width);
            Tensor ref_loss = mse((*reference)(x), y);
            ref_loss.backward();
            if (pipe.is_last())
              CHECK(close(loss, ref_loss));
            else
              CHECK(!loss.defined());
            check_stage_grads(*model, *reference);
            const int expected_live =
                schedule == parallel::Schedule::GPipe ? m : std::min(n - me, m);
            CHECK(pipe.stats().peak_live_microbatches == expected_live);
            CHECK(autograd::must_run_pending() == 0);
          }
          Tensor predicted = pipe.predict(x);
          if (pipe.is_last()) CHECK(close(predicted, (*pipeline_model(width))(x)));
        }
  }

  TEST_CASE("side inputs reach every stage: packed windows through Llama blocks") {
    // Four LlamaBlocks cut into stages; window 0 packs two documents (positions restart),
    // window 1 one; each stage's blocks must see its micro-batch's positions and documents.
    const int n = dist::world_size(), me = dist::rank();
    const int64_t t = 6, dim = 8;
    auto blocks = [dim] {
      manual_seed(41);
      auto model = std::make_shared<nn::Sequential>();
      for (int i = 0; i < 4; ++i)
        model->push_back(std::make_shared<models::LlamaBlock>(
            dim, models::LlamaBlockOptions{.heads = 2, .kv_heads = 1, .hidden = 16}));
      model->to(kFloat64);
      return model;
    };
    const Tensor positions = from_vector<int64_t>({0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 4, 5}, {2, t});
    const Tensor documents = from_vector<int64_t>({0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0}, {2, t});
    const Tensor x = shared_randn({2, t, dim}, 42), y = shared_randn({2, t, dim}, 43);
    auto model = blocks();
    auto stage = parallel::pipeline_stage(*model, me, n);
    for (int m : {1, 2}) {
      CAPTURE(m);
      parallel::Pipeline pipe(*stage, {.microbatches = m});
      model->zero_grad();
      Tensor loss = pipe.train_step({x, positions, documents}, y, mse);
      auto reference = blocks();
      Tensor ref_loss = mse((*reference)({x, positions, documents}), y);
      ref_loss.backward();
      if (pipe.is_last()) CHECK(close(loss, ref_loss));
      check_stage_grads(*model, *reference);
      // without them every stage would see one document at positions 0 .. T-1
      Tensor predicted = pipe.predict({x, positions, documents});
      if (pipe.is_last()) {
        CHECK(close(predicted, (*reference)({x, positions, documents})));
        CHECK(!close(predicted, (*reference)(x)));
      }
      CHECK(autograd::must_run_pending() == 0);
    }
  }

  TEST_CASE("GPT-2 in stages: the head's tied embedding steps as one process's, clipped once") {
    // Every rank a stage (tensor groups of one rank); the first and the last stage both hold
    // tokens.weight, the embedding on one and the head on the other.
    const int n = dist::world_size();
    std::vector<std::vector<int>> singletons;
    for (int r = 0; r < n; ++r) singletons.push_back({r});
    const dist::Group alone = dist::split_group(dist::world(), singletons);
    const models::GPT2Options options{
        .vocab = 16, .dim = 16, .layers = 4, .heads = 2, .max_positions = 8};
    manual_seed(11);
    models::GPT2 whole(options, {.tensor = alone});
    whole.to(kFloat64);
    models::GPT2 stage(options, {.tensor = alone, .stage = dist::rank(), .stages = n});
    stage.to(kFloat64);
    nn::NamedTensors state;  // the whole model's values of this stage's names
    const auto mine = stage.named_parameters(), all = whole.state_dict();
    for (const auto& entry : all)
      if (std::any_of(mine.begin(), mine.end(),
                      [&](const auto& p) { return p.first == entry.first; }))
        state.push_back(entry);
    stage.load_state_dict(state);
    REQUIRE(bool(stage.tokens) == (dist::rank() == 0 || dist::rank() == n - 1));
    parallel::Pipeline pipe(stage, {.microbatches = 2});
    // SGD with momentum: a step linear in the gradients (Adam's would magnify rounding where a
    // gradient is nearly zero)
    optim::SGD step_stage(stage.parameters(), {.lr = 0.5, .momentum = 0.9});
    optim::SGD step_whole(whole.parameters(), {.lr = 0.5, .momentum = 0.9});
    auto loss_of = [&](const Tensor& logits, const Tensor& targets) {
      return cross_entropy(logits.reshape({-1, options.vocab}), targets.reshape({-1}));
    };
    Generator g(5);
    for (int step = 0; step < 3; ++step) {
      CAPTURE(step);
      const Tensor tokens = randint(0, options.vocab, {4, 8}, {.dtype = kInt64}, &g);
      const Tensor targets = randint(0, options.vocab, {4, 8}, {.dtype = kInt64}, &g);
      step_stage.zero_grad();
      step_whole.zero_grad();
      const Tensor loss = pipe.train_step(tokens, targets, loss_of);
      const Tensor expected = loss_of(whole(tokens), targets);
      expected.backward();
      if (pipe.is_last()) CHECK(close(loss, expected, 1e-10));
      // The tied weight counts once in the whole model's norm.
      CHECK(parallel::clip_grad_norm_(stage.parameters(), 1e9) ==
            doctest::Approx(optim::clip_grad_norm_(whole.parameters(), 1e9)).epsilon(1e-10));
      step_stage.step();
      step_whole.step();
    }
    const auto expected = whole.named_parameters();
    for (const auto& [name, p] : stage.named_parameters()) {
      const std::string label = name;  // a copy: CAPTURE's lambda cannot take a binding
      CAPTURE(label);
      const auto it = std::find_if(expected.begin(), expected.end(),
                                   [&](const auto& e) { return e.first == label; });
      REQUIRE(it != expected.end());
      CHECK(close(p, it->second, 1e-10));  // tokens.weight on the last stage too
    }
    if (n > 1) {
      std::vector<nn::KVCache> caches = stage.make_caches(4);
      CHECK_THROWS_WITH_AS(stage.forward_cached(full({1, 1}, 1.0, {.dtype = kInt64}), caches),
                           doctest::Contains("not split into pipeline stages"), Error);
    }
    if (n > 1) {  // marked on the first stage alone: every stage raises
      auto lone = std::make_shared<nn::Linear>(2, 2);
      if (dist::rank() == 0) parallel::tie_first_and_last_stage(lone->weight);
      CHECK_THROWS_WITH_AS(parallel::Pipeline(*lone, {.microbatches = 1}),
                           doctest::Contains("tied across the first and the last stage"), Error);
    }
    if (n == 2) {  // tied on both ends, trained through FSDP's shards: every stage raises
      const dist::Group alone = dist::split_group(dist::world(), {{0}, {1}});
      auto lone = std::make_shared<nn::Linear>(2, 2);
      parallel::tie_first_and_last_stage(lone->weight);
      parallel::FullyShardedDataParallel fsdp(*lone, {.group = alone});
      CHECK_THROWS_WITH_AS(parallel::Pipeline(fsdp, {.microbatches = 1}),
                           doctest::Contains("wrap such stages in DistributedDataParallel"), Error);
    }
  }

  TEST_CASE("GPT-2 tied in stages under DDP (PP 2 x DP 2) gives one process's gradients") {
    // The tie is recorded without a group until the pipeline knows its own: the DDP built over
    // the data group before the pipeline takes the tied embedding as a replica.
    if (dist::world_size() != 4) return;
    const parallel::ProcessMesh mesh({.data = 2, .pipeline = 2});
    const dist::Group alone = dist::split_group(dist::world(), {{0}, {1}, {2}, {3}});
    const models::GPT2Options options{
        .vocab = 16, .dim = 16, .layers = 2, .heads = 2, .max_positions = 8};
    manual_seed(12);
    models::GPT2 whole(options, {.tensor = alone});
    whole.to(kFloat64);
    models::GPT2 stage(options, {.tensor = alone, .stage = mesh.pipeline_rank(), .stages = 2});
    stage.to(kFloat64);
    nn::NamedTensors state;
    const auto mine = stage.named_parameters();
    for (const auto& entry : whole.state_dict())
      if (std::any_of(mine.begin(), mine.end(),
                      [&](const auto& p) { return p.first == entry.first; }))
        state.push_back(entry);
    stage.load_state_dict(state);
    parallel::DistributedDataParallel ddp(stage, {.group = mesh.data()});
    parallel::Pipeline pipe(ddp, {.microbatches = 2, .group = mesh.pipeline()});
    auto loss_of = [&](const Tensor& logits, const Tensor& targets) {
      return cross_entropy(logits.reshape({-1, options.vocab}), targets.reshape({-1}));
    };
    Generator g(6);
    const Tensor tokens = randint(0, options.vocab, {8, 8}, {.dtype = kInt64}, &g);
    const Tensor targets = randint(0, options.vocab, {8, 8}, {.dtype = kInt64}, &g);
    const int64_t d = mesh.data_rank();  // this data rank's half of the batch
    pipe.train_step(tokens.narrow(0, 4 * d, 4), targets.narrow(0, 4 * d, 4), loss_of);
    loss_of(whole(tokens), targets).backward();
    const auto expected = whole.named_parameters();
    for (const auto& [name, p] : stage.named_parameters()) {
      const std::string label = name;
      CAPTURE(label);
      const auto it = std::find_if(expected.begin(), expected.end(),
                                   [&](const auto& e) { return e.first == label; });
      REQUIRE(it != expected.end());
      CHECK(close(p.grad(), it->second.grad(), 1e-10));  // tokens.weight on both ends
    }
  }

  TEST_CASE(
      "NaN in one micro-batch of the last stage: every rank of every stage raises, then trains") {
    // check_finite stages: the last stage's wrapper finds NaN in its averaged gradients before
    // it sends the first stage its gradient; the schedule goes on, and every rank raises.
    const int n = dist::world_size();
    if (n != 2 && n != 4) return;
    const parallel::ProcessMesh mesh({.data = n / 2, .pipeline = 2});
    for (const bool sharded : {false, true}) {
      CAPTURE(sharded);
      auto model = pipeline_model(8);
      auto stage = parallel::pipeline_stage(*model, mesh.pipeline_rank(), 2);
      std::unique_ptr<parallel::DataParallelWrapper> wrapper;
      if (sharded)
        wrapper = std::make_unique<parallel::FullyShardedDataParallel>(
            *stage, parallel::FSDPOptions{.group = mesh.data(), .check_finite = true});
      else
        wrapper = std::make_unique<parallel::DistributedDataParallel>(
            *stage, parallel::DDPOptions{.group = mesh.data(), .check_finite = true});
      parallel::Pipeline pipe(*wrapper, {.microbatches = 2, .group = mesh.pipeline()});
      optim::SGD sgd(wrapper->trained_parameters(), {.lr = 0.1});
      int micro = 0;
      bool poison = true;
      auto loss = [&](const Tensor& out, const Tensor& target) {
        const Tensor l = mse(out, target);
        return poison && micro++ % 2 == 1 ? l * std::nan("") : l;  // micro-batch 1 of 2
      };
      const Tensor x = shared_randn({8, 5}, 31), y = shared_randn({8, 3}, 32);
      CHECK_THROWS_WITH_AS(pipe.train_step(x, y, loss), doctest::Contains("NaN or infinity"),
                           Error);
      CHECK_FALSE(wrapper->gradients_finite());
      sgd.zero_grad();  // skip the step, as the error says; the next one trains
      poison = false;
      const Tensor mean = pipe.train_step(x, y, loss);
      CHECK(wrapper->gradients_finite());
      if (pipe.is_last()) CHECK(std::isfinite(mean.item<double>()));
      for (const Tensor& p : wrapper->trained_parameters())
        if (p.grad().defined()) CHECK(all_finite(p.grad()));
      sgd.step();
    }
  }

  TEST_CASE("interleaved virtual stages give one process's gradients") {
    const int p = dist::world_size(), me = dist::rank(), v = 2;
    if (p < 2) return;
    // 2 p v children, every virtual stage a Linear and a Tanh of equal size (balanced cuts)
    auto inputs_of = [](int64_t width) { return width > 6 ? width : int64_t{5}; };
    auto make = [&](int64_t width) {
      manual_seed(17);
      auto model = std::make_shared<nn::Sequential>();
      for (int i = 0; i < p * v; ++i) {
        model->push_back(std::make_shared<nn::Linear>(i == 0 ? inputs_of(width) : width, width));
        model->push_back(nn::Tanh());
      }
      model->to(kFloat64);
      return model;
    };
    for (parallel::Schedule schedule : {parallel::Schedule::GPipe, parallel::Schedule::OneFOneB})
      for (int m : {p, 2 * p, 3 * p})
        for (int64_t width : {int64_t{6}, int64_t{1024}}) {
          if (width > 6 && m != 2 * p) continue;  // large messages: one case per schedule
          CAPTURE(int(schedule));
          CAPTURE(m);
          CAPTURE(width);
          auto model = make(width);
          auto chunks = parallel::pipeline_chunks(*model, me, p, v);
          REQUIRE(chunks.size() == size_t(v));
          for (const auto& chunk : chunks) CHECK(chunk->size() == 2);
          parallel::Pipeline pipe({chunks[0].get(), chunks[1].get()},
                                  {.schedule = schedule, .microbatches = m});
          // 64 KB activations per micro-batch in the large case (8 rows of 1024 doubles)
          const int64_t rows = width > 6 ? 8 : 2;
          Tensor x = shared_randn({rows * m, inputs_of(width)}, 41),
                 y = shared_randn({rows * m, width}, 42);
          Tensor loss = pipe.train_step(x, y, mse);
          auto reference = make(width);
          Tensor ref_loss = mse((*reference)(x), y);
          ref_loss.backward();
          if (pipe.is_last()) CHECK(close(loss, ref_loss));
          check_stage_grads(*model, *reference);
          if (schedule == parallel::Schedule::GPipe)
            CHECK(pipe.stats().peak_live_microbatches == m * v);
          else  // Megatron-LM's warm-up, then one forward and one backward in turn
            CHECK(pipe.stats().peak_live_microbatches ==
                  std::min(std::min((p - me - 1) * 2 + (v - 1) * p, m * v) + 1, m * v));
          Tensor predicted = pipe.predict(x);
          if (pipe.is_last()) CHECK(close(predicted, (*make(width))(x)));
        }
    CHECK_THROWS_WITH_AS(parallel::Pipeline({nullptr}, {}), doctest::Contains("null pointer"),
                         Error);
  }

  TEST_CASE("a balanced pipeline idles (p - 1) / (m + p - 1) of the step") {
    const int p = dist::world_size(), me = dist::rank();
    nn::Sequential model;
    for (int i = 0; i < p; ++i) model.push_back(std::make_shared<DelayStage>());
    auto stage = parallel::pipeline_stage(model, me, p);
    REQUIRE(stage->size() == 1);
    for (parallel::Schedule schedule : {parallel::Schedule::GPipe, parallel::Schedule::OneFOneB})
      for (int m : {4, 8}) {
        CAPTURE(int(schedule));
        CAPTURE(m);
        parallel::Pipeline pipe(*stage, {.schedule = schedule, .microbatches = m});
        Tensor x = ones({m, 4}), y = zeros({m, 4});
        pipe.train_step(x, y, mse);  // warm up
        // A descheduled rank (a loaded machine) shows up as idle time on its peers, or as busy
        // time of its own: of five steps, the one nearest the schedule's bubble is the least
        // disturbed. A schedule that serializes the stages misses it in every step.
        const double expected = double(p - 1) / (m + p - 1);
        std::vector<double> idles;
        for (int trial = 0; trial < 5; ++trial) {
          dist::barrier();
          const auto start = std::chrono::steady_clock::now();
          pipe.train_step(x, y, mse);
          dist::barrier();
          const double wall =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          const double busy = pipe.stats().step_s - pipe.stats().waiting_s;
          idles.push_back(1.0 - busy / wall);
        }
        const double idle = *std::min_element(idles.begin(), idles.end(), [&](double a, double b) {
          return std::abs(a - expected) < std::abs(b - expected);
        });
        CAPTURE(idle);
        CAPTURE(expected);
        CHECK(std::abs(idle - expected) <= 0.05);
        model.zero_grad();
      }
  }

  TEST_CASE("a step that starts with communication left pending is an error on every rank") {
    if (dist::world_size() < 2) return;
    auto model = pipeline_model(8);
    auto stage = parallel::pipeline_stage(*model, dist::rank(), dist::world_size());
    parallel::Pipeline pipe(*stage, {.microbatches = 2});
    Tensor forgotten = dist::functional::all_reduce_sum(leaf(ones({2})));
    Tensor x = shared_randn({4, 5}, 1), y = shared_randn({4, 3}, 2);
    CHECK_THROWS_WITH_AS(pipe.train_step(x, y, mse), doctest::Contains("never ran backward"),
                         Error);
    autograd::clear_must_run();
    CHECK_NOTHROW(pipe.train_step(x, y, mse));
    // the first and last stages hold the batch and check it (a middle stage cannot: it would
    // wait for the watchdog)
    if (dist::world_size() == 2)
      CHECK_THROWS_WITH_AS(parallel::Pipeline(*stage, {.microbatches = 3}).train_step(x, y, mse),
                           doctest::Contains("micro-batches"), Error);
  }

  TEST_CASE("a send-only stage that forgets its backward cannot step") {
    const int me = dist::rank();
    if (dist::world_size() < 2 || me > 1) return;
    manual_seed(1);
    nn::Linear layer(4, 4);
    layer.to(kFloat64);
    optim::SGD opt(layer.parameters(), {.lr = 0.1});
    Tensor x = shared_randn({3, 4}, 7);
    if (me == 0) {
      dist::functional::remote_send(layer(x), 1);  // no loss here: the gradient comes back
      CHECK_THROWS_WITH_AS(opt.step(), doctest::Contains("have not run backward"), Error);
      autograd::backward({});  // receives it
      REQUIRE(layer.weight.grad().defined());
      CHECK_NOTHROW(opt.step());
    } else {
      Tensor received = dist::functional::remote_recv(0);
      sum(layer(received)).backward();
      CHECK_NOTHROW(opt.step());
    }
    dist::wait_sends();
  }

  TEST_CASE("isend: neighbours send large tensors to each other before either receives") {
    const int n = dist::world_size(), me = dist::rank();
    if (n < 2) return;
    const int next = (me + 1) % n, previous = (me + n - 1) % n;
    Tensor to_next = full({1 << 17}, double(me)), to_previous = full({1 << 17}, 100.0 + me);
    auto a = dist::isend(to_next, next, dist::world(), 5);
    auto b = dist::isend(to_previous, previous, dist::world(), 6);
    Tensor from_previous = empty({1 << 17}), from_next = empty({1 << 17});
    dist::recv(from_previous, previous, dist::world(), 5);
    dist::recv(from_next, next, dist::world(), 6);
    dist::wait_sends();
    CHECK(a.is_completed());
    CHECK(b.is_completed());
    CHECK(equal(from_previous, full({1 << 17}, double(previous))));
    CHECK(equal(from_next, full({1 << 17}, 100.0 + next)));
  }
}

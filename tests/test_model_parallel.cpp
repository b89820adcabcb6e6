// Model parallelism against one process: tensor-parallel layers and the vocab-parallel loss
// against their unsharded counterparts built from the same seed, pipeline schedules against
// one process on the whole batch, hybrid data x tensor parallelism step for step, and meshes.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <thread>
#include <vector>

#include "weave/weave.h"

using namespace weave;
using autograd::FunctionContext;

namespace {

bool close(const Tensor& got, const Tensor& expected, double rtol = 1e-10) {
  return got.defined() && got.shape() == expected.shape() && allclose(got, expected, rtol, 1e-13);
}

// This rank's slice along axis of a tensor split over the group.
Tensor piece(const Tensor& full, int axis, const dist::Group& g) {
  const int64_t n = full.size(axis) / g.size();
  return full.narrow(axis, g.rank() * n, n);
}

// The same values on every rank.
Tensor shared_randn(const Shape& shape, uint64_t seed) {
  Generator g(seed);
  return randn(shape, {.dtype = kFloat64}, &g);
}

Tensor leaf(const Tensor& t) {
  return t.detach().contiguous().clone().requires_grad_(true);
}

void check_state_equal(const nn::NamedTensors& got, const nn::NamedTensors& expected,
                       double rtol = 1e-10) {
  REQUIRE(got.size() == expected.size());
  for (size_t i = 0; i < got.size(); ++i) {
    CAPTURE(got[i].first);
    CHECK(got[i].first == expected[i].first);
    CHECK(close(got[i].second, expected[i].second, rtol));
  }
}

// fc1 (column) -> ReLU -> fc2 (row): 8 -> 12 -> 6, float64, from `seed`.
struct TensorParallelMlp {
  std::shared_ptr<parallel::ColumnParallelLinear> fc1;
  std::shared_ptr<parallel::RowParallelLinear> fc2;
  std::shared_ptr<nn::Sequential> model;
  TensorParallelMlp(uint64_t seed, const dist::Group& tp) {
    manual_seed(seed);
    fc1 = std::make_shared<parallel::ColumnParallelLinear>(8, 12, tp);
    fc2 = std::make_shared<parallel::RowParallelLinear>(12, 6, tp);
    model = std::make_shared<nn::Sequential>(
        std::initializer_list<std::shared_ptr<nn::Module>>{fc1, nn::ReLU(), fc2});
    model->to(kFloat64);
  }
};

struct ReferenceMlp {
  std::shared_ptr<nn::Linear> fc1, fc2;
  std::shared_ptr<nn::Sequential> model;
  explicit ReferenceMlp(uint64_t seed) {
    manual_seed(seed);
    fc1 = std::make_shared<nn::Linear>(8, 12);
    fc2 = std::make_shared<nn::Linear>(12, 6);
    model = std::make_shared<nn::Sequential>(
        std::initializer_list<std::shared_ptr<nn::Module>>{fc1, nn::ReLU(), fc2});
    model->to(kFloat64);
  }
};

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

Tensor mse(const Tensor& out, const Tensor& target) {
  return mse_loss(out, target);
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

std::vector<int> divisors(int n) {
  std::vector<int> out;
  for (int d = 1; d <= n; ++d)
    if (n % d == 0) out.push_back(d);
  return out;
}

}  // namespace

TEST_SUITE("model_parallel") {
  TEST_CASE("every mesh layout puts each rank in exactly one group of each kind") {
    const int n = dist::world_size(), me = dist::rank();
    for (int d : divisors(n))
      for (int t : divisors(n / d)) {
        const int p = n / (d * t);
        CAPTURE(d);
        CAPTURE(t);
        parallel::ProcessMesh mesh({.data = d, .tensor = t, .pipeline = p});
        CHECK(mesh.data().size() == d);
        CHECK(mesh.tensor().size() == t);
        CHECK(mesh.pipeline().size() == p);
        const int dr = mesh.data_rank(), tr = mesh.tensor_rank(), pr = mesh.pipeline_rank();
        CHECK(mesh.rank_at(dr, tr, pr) == me);
        for (int i = 0; i < t; ++i) CHECK(mesh.tensor().global_rank(i) == mesh.rank_at(dr, i, pr));
        for (int i = 0; i < d; ++i) CHECK(mesh.data().global_rank(i) == mesh.rank_at(i, tr, pr));
        for (int i = 0; i < p; ++i)
          CHECK(mesh.pipeline().global_rank(i) == mesh.rank_at(dr, tr, i));
        // Every rank names its group of each kind by the group's first rank: each group is
        // named by exactly its members.
        for (const dist::Group* g : {&mesh.data(), &mesh.tensor(), &mesh.pipeline()}) {
          Tensor members = zeros({n}, {.dtype = kInt64});
          members.narrow(0, g->global_rank(0), 1).fill_(1);
          dist::all_reduce(members);
          CHECK(members.to_vector<int64_t>()[g->global_rank(0)] == g->size());
          CHECK(sum(members).item<int64_t>() == n);
        }
        CHECK(mesh.str().find("tensor=" + std::to_string(t)) != std::string::npos);
      }
    CHECK_THROWS_WITH_AS(parallel::ProcessMesh({.data = n + 1}),
                         doctest::Contains("ranks, but the world has"), Error);
  }

  TEST_CASE("tensor-parallel MLP equals one process: values, gradients, 5 Adam steps") {
    const dist::Group tp = dist::world();
    TensorParallelMlp sharded(11, tp);
    ReferenceMlp reference(11);
    check_state_equal(parallel::gather_state_dict(*sharded.model), reference.model->state_dict());
    optim::Adam opt(sharded.model->parameters(), {.lr = 1e-2});
    optim::Adam ref_opt(reference.model->parameters(), {.lr = 1e-2});
    for (int step = 0; step < 5; ++step) {
      CAPTURE(step);
      Tensor x = shared_randn({5, 8}, 100 + step), y = shared_randn({5, 6}, 200 + step);
      opt.zero_grad();
      ref_opt.zero_grad();
      Tensor out = (*sharded.model)(x), ref_out = (*reference.model)(x);
      CHECK(close(out, ref_out));
      Tensor loss = mse(out, y), ref_loss = mse(ref_out, y);
      CHECK(close(loss, ref_loss));
      loss.backward();
      ref_loss.backward();
      CHECK(close(sharded.fc1->weight.grad(), piece(reference.fc1->weight.grad(), 0, tp)));
      CHECK(close(sharded.fc1->bias.grad(), piece(reference.fc1->bias.grad(), 0, tp)));
      CHECK(close(sharded.fc2->weight.grad(), piece(reference.fc2->weight.grad(), 1, tp)));
      CHECK(close(sharded.fc2->bias.grad(), reference.fc2->bias.grad()));
      opt.step();
      ref_opt.step();
    }
    check_state_equal(parallel::gather_state_dict(*sharded.model), reference.model->state_dict());
    // and back: the reference's state, sharded, loads into a fresh sharded model
    TensorParallelMlp fresh(99, tp);
    fresh.model->load_state_dict(
        parallel::shard_state_dict(reference.model->state_dict(), *fresh.model));
    check_state_equal(parallel::gather_state_dict(*fresh.model), reference.model->state_dict());
    CHECK(parallel::split_axes(*fresh.model) ==
          std::map<std::string, int>{{"0.weight", 0}, {"0.bias", 0}, {"2.weight", 1}});
  }

  TEST_CASE("column layer gathering its output, row layer splitting its input") {
    const dist::Group tp = dist::world();
    manual_seed(5);
    parallel::ColumnParallelLinear column(8, 12, tp, {.gather_output = true});
    parallel::RowParallelLinear row(12, 6, tp, {.input_is_parallel = false});
    column.to(kFloat64);
    row.to(kFloat64);
    manual_seed(5);
    nn::Linear ref_column(8, 12), ref_row(12, 6);
    ref_column.to(kFloat64);
    ref_row.to(kFloat64);
    Tensor x = leaf(shared_randn({3, 8}, 1)), ref_x = leaf(x);
    Tensor w = shared_randn({3, 6}, 2);
    Tensor out = row(column(x)), ref_out = ref_row(ref_column(ref_x));
    CHECK(close(out, ref_out));
    sum(out * w).backward();
    sum(ref_out * w).backward();
    CHECK(close(x.grad(), ref_x.grad()));  // every rank: the replicated input's gradient
    CHECK(close(column.weight.grad(), piece(ref_column.weight.grad(), 0, tp)));
    CHECK(close(row.weight.grad(), piece(ref_row.weight.grad(), 1, tp)));
    CHECK(close(row.bias.grad(), ref_row.bias.grad()));
    if (tp.size() > 1)
      CHECK_THROWS_WITH_AS(parallel::ColumnParallelLinear(8, 12 * tp.size() + 1, tp),
                           doctest::Contains("does not divide"), Error);
  }

  TEST_CASE("vocab-parallel embedding and cross-entropy equal the unsharded ones") {
    const dist::Group tp = dist::world();
    manual_seed(7);
    parallel::VocabParallelEmbedding embedding(12, 5, tp);
    embedding.to(kFloat64);
    manual_seed(7);
    nn::Embedding ref_embedding(12, 5);
    ref_embedding.to(kFloat64);
    Generator g(3);
    Tensor ids = randint(0, 12, {3, 4}, {.dtype = kInt64}, &g);
    Tensor w = shared_randn({3, 4, 5}, 4);
    Tensor out = embedding(ids), ref_out = ref_embedding(ids);
    CHECK(close(out, ref_out));
    sum(out * w).backward();
    sum(ref_out * w).backward();
    CHECK(close(embedding.weight.grad(), piece(ref_embedding.weight.grad(), 0, tp)));
    CHECK_THROWS_WITH_AS(embedding(full({2}, 12, {.dtype = kInt64})),
                         doctest::Contains("ids must lie in [0, 12)"), Error);

    Tensor targets = randint(0, 12, {6}, {.dtype = kInt64}, &g);
    for (double scale : {1.0, 1000.0}) {  // large logits: the shift by the global max matters
      CAPTURE(scale);
      Tensor logits = shared_randn({6, 12}, 5) * scale;
      Tensor ref_logits = leaf(logits), local = leaf(piece(logits, 1, tp));
      Tensor loss = parallel::vocab_parallel_cross_entropy(local, targets, tp);
      Tensor ref_loss = cross_entropy(ref_logits, targets);
      CHECK(std::isfinite(loss.item<double>()));
      CHECK(close(loss, ref_loss));
      loss.backward();
      ref_loss.backward();
      CHECK(close(local.grad(), piece(ref_logits.grad(), 1, tp)));
    }
  }

  TEST_CASE("sequence parallelism equals one process on the whole sequence") {
    const dist::Group tp = dist::world();
    manual_seed(21);
    parallel::SequenceParallelLayerNorm norm({6}, tp);
    parallel::ColumnParallelLinear column(6, 12, tp, {.sequence_parallel = true});
    parallel::RowParallelLinear row(12, 6, tp, {.sequence_parallel = true});
    for (nn::Module* m : std::initializer_list<nn::Module*>{&norm, &column, &row}) m->to(kFloat64);
    manual_seed(21);
    nn::LayerNorm ref_norm({6});
    nn::Linear ref_column(6, 12), ref_row(12, 6);
    for (nn::Module* m : std::initializer_list<nn::Module*>{&ref_norm, &ref_column, &ref_row})
      m->to(kFloat64);
    // [sequence 12, batch 2, hidden 6]; each rank holds its slice of the sequence
    Tensor x = shared_randn({12, 2, 6}, 8), y = shared_randn({12, 2, 6}, 9);
    Tensor ref_x = leaf(x), my_x = leaf(piece(x, 0, tp));
    Tensor out = row(relu(column(norm(my_x))));
    Tensor ref_out = ref_row(relu(ref_column(ref_norm(ref_x))));
    CHECK(close(out, piece(ref_out, 0, tp)));
    // each rank's loss covers its rows; their sum is the whole sequence's loss
    mse_loss(out, piece(y, 0, tp), Reduction::Sum).backward();
    mse_loss(ref_out, y, Reduction::Sum).backward();
    CHECK(close(my_x.grad(), piece(ref_x.grad(), 0, tp)));
    CHECK(close(norm.weight.grad(), ref_norm.weight.grad()));
    CHECK(close(norm.bias.grad(), ref_norm.bias.grad()));
    CHECK(close(column.weight.grad(), piece(ref_column.weight.grad(), 0, tp)));
    CHECK(close(column.bias.grad(), piece(ref_column.bias.grad(), 0, tp)));
    CHECK(close(row.weight.grad(), piece(ref_row.weight.grad(), 1, tp)));
    CHECK(close(row.bias.grad(), ref_row.bias.grad()));
  }

  TEST_CASE("parallel transformer blocks equal nn::TransformerBlock at any group size") {
    // 12 heads and 24 hidden units divide among 1-4 ranks; head_dim 3 is no vector width.
    const dist::Group tp = dist::world();
    const int64_t dim = 36, heads = 12, hidden = 24, t = 12, b = 2;
    nn::TransformerBlock ref(dim, heads, {.hidden = hidden});
    ref.to(kFloat64);
    {
      // random norms and biases too: the ones and zeros they start from hide a swapped pair
      NoGradGuard no_grad;
      Generator g(43);
      for (Tensor& p : ref.parameters()) p.copy_(randn(p.shape(), {.dtype = kFloat64}, &g) * 0.5);
    }
    const Tensor x_bt = shared_randn({b, t, dim}, 44), w_bt = shared_randn({b, t, dim}, 45);
    Tensor ref_x = leaf(x_bt);
    Tensor ref_out = ref(ref_x);
    sum(ref_out * w_bt).backward();
    nn::NamedTensors ref_grads;
    for (const auto& [name, p] : ref.named_parameters()) ref_grads.emplace_back(name, p.grad());
    const Tensor x = x_bt.transpose(0, 1), w = w_bt.transpose(0, 1);  // sequence first

    for (bool sp : {false, true}) {
      CAPTURE(sp);
      parallel::ParallelTransformerBlock block(dim, heads, tp,
                                               {.hidden = hidden, .sequence_parallel = sp});
      block.to(kFloat64);
      block.load_state_dict(parallel::shard_state_dict(ref.state_dict(), block));
      check_state_equal(parallel::gather_state_dict(block), ref.state_dict(), 0);
      CHECK(block.attention->local_heads() == heads / tp.size());
      // with sequence parallelism each rank holds (and its loss covers) its slice of the
      // sequence; without, the loss is replicated and counted once
      Tensor my_x = leaf(sp ? piece(x, 0, tp) : x);
      Tensor out = block(my_x);
      const Tensor expected = ref_out.detach().transpose(0, 1);
      CHECK(close(out, sp ? piece(expected, 0, tp) : expected));
      sum(out * (sp ? piece(w, 0, tp) : w)).backward();
      const Tensor expected_dx = ref_x.grad().transpose(0, 1);
      CHECK(close(my_x.grad(), sp ? piece(expected_dx, 0, tp) : expected_dx));
      nn::NamedTensors grads;
      for (const auto& [name, p] : block.named_parameters()) grads.emplace_back(name, p.grad());
      check_state_equal(grads, parallel::shard_state_dict(ref_grads, block));
      CHECK(autograd::must_run_pending() == 0);
    }

    // Decoding with a KV cache on the local heads: position by position equals the whole
    // causal sequence at once.
    parallel::ParallelTransformerBlock block(dim, heads, tp, {.hidden = hidden});
    block.to(kFloat64);
    block.load_state_dict(parallel::shard_state_dict(ref.state_dict(), block));
    NoGradGuard no_grad;
    nn::KVCache cache(t);
    std::vector<Tensor> steps;
    steps.push_back(block.forward(x.narrow(0, 0, 5), cache));
    for (int64_t i = 5; i < t; ++i) steps.push_back(block.forward(x.narrow(0, i, 1), cache));
    CHECK(close(cat(steps, 0), ref_out.detach().transpose(0, 1)));
  }

  TEST_CASE("ParallelAttention and ParallelMLP alone; bad shapes fail on every rank") {
    const dist::Group tp = dist::world();
    const int n = tp.size();
    const int64_t dim = 24, heads = 12, t = 4 * n, b = 3;
    nn::MultiheadAttention ref_attention(dim, heads);  // not causal
    nn::MLP ref_mlp(dim, 8 * n, {.tanh_gelu = true});
    parallel::ParallelAttention attention(dim, heads, tp, {.sequence_parallel = true});
    parallel::ParallelMLP mlp(dim, 8 * n, tp, {.tanh_gelu = true});
    for (nn::Module* m :
         std::initializer_list<nn::Module*>{&ref_attention, &ref_mlp, &attention, &mlp})
      m->to(kFloat64);
    attention.load_state_dict(parallel::shard_state_dict(ref_attention.state_dict(), attention));
    mlp.load_state_dict(parallel::shard_state_dict(ref_mlp.state_dict(), mlp));
    const Tensor x_bt = shared_randn({b, t, dim}, 46), w_bt = shared_randn({b, t, dim}, 47);
    const Tensor x = x_bt.transpose(0, 1), w = w_bt.transpose(0, 1);

    // sequence-parallel attention: each rank's slice of the sequence in and out
    // (each reference runs its backward first: a backward also runs the collectives that
    // earlier forwards left pending, which would consume the parallel graph's)
    Tensor ref_x = leaf(x_bt), my_x = leaf(piece(x, 0, tp));
    Tensor ref_out = ref_attention(ref_x);
    sum(ref_out * w_bt).backward();
    Tensor out = attention(my_x);
    CHECK(close(out, piece(ref_out.detach().transpose(0, 1), 0, tp)));
    sum(out * piece(w, 0, tp)).backward();
    CHECK(close(my_x.grad(), piece(ref_x.grad().transpose(0, 1), 0, tp)));
    CHECK(close(attention.qkv->weight.grad(), piece(ref_attention.qkv->weight.grad(), 0, tp)));
    CHECK(close(attention.qkv->bias.grad(), piece(ref_attention.qkv->bias.grad(), 0, tp)));
    CHECK(close(attention.out->weight.grad(), piece(ref_attention.out->weight.grad(), 1, tp)));
    CHECK(close(attention.out->bias.grad(), ref_attention.out->bias.grad()));

    // the MLP on the whole sequence, its loss replicated
    Tensor ref_h = leaf(x_bt), my_h = leaf(x);
    Tensor ref_y = ref_mlp(ref_h);
    sum(ref_y * w_bt).backward();
    Tensor y = mlp(my_h);
    CHECK(close(y, ref_y.detach().transpose(0, 1)));
    sum(y * w).backward();
    CHECK(close(my_h.grad(), ref_h.grad().transpose(0, 1)));
    CHECK(close(mlp.fc1->weight.grad(), piece(ref_mlp.fc1->weight.grad(), 0, tp)));
    CHECK(close(mlp.fc1->bias.grad(), piece(ref_mlp.fc1->bias.grad(), 0, tp)));
    CHECK(close(mlp.fc2->weight.grad(), piece(ref_mlp.fc2->weight.grad(), 1, tp)));
    CHECK(close(mlp.fc2->bias.grad(), ref_mlp.fc2->bias.grad()));

    // Bad input raises on every rank, before any collective (no rank is left waiting).
    if (n > 1)
      CHECK_THROWS_WITH_AS(parallel::ParallelAttention(2 * (n + 1), n + 1, tp),
                           doctest::Contains("heads do not divide among the"), Error);
    CHECK_THROWS_WITH_AS(attention(randn({t, b, dim + 1}, {.dtype = kFloat64})),
                         doctest::Contains("expected input [T, B, 24] (sequence first)"), Error);
    nn::KVCache cache(8);
    CHECK_THROWS_WITH_AS(attention.forward(my_x, cache),
                         doctest::Contains("decoding with a KV cache needs the whole sequence"),
                         Error);
    CHECK(autograd::must_run_pending() == 0);
  }

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
          Tensor x = shared_randn({8, 5}, 31), y = shared_randn({8, 3}, 32);
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

  TEST_CASE("interleaved virtual stages give one process's gradients") {
    const int p = dist::world_size(), me = dist::rank(), v = 2;
    if (p < 2) return;
    auto make = [&] {  // 2 p v children: every virtual stage gets a Linear and a Tanh
      manual_seed(17);
      auto model = std::make_shared<nn::Sequential>();
      for (int i = 0; i < p * v; ++i) {
        model->push_back(std::make_shared<nn::Linear>(i == 0 ? 5 : 6, 6));
        model->push_back(nn::Tanh());
      }
      model->to(kFloat64);
      return model;
    };
    for (parallel::Schedule schedule : {parallel::Schedule::GPipe, parallel::Schedule::OneFOneB})
      for (int m : {p, 2 * p}) {
        CAPTURE(int(schedule));
        CAPTURE(m);
        auto model = make();
        auto chunks = parallel::pipeline_chunks(*model, me, p, v);
        REQUIRE(chunks.size() == size_t(v));
        for (const auto& chunk : chunks) CHECK(chunk->size() == 2);
        parallel::Pipeline pipe({chunks[0].get(), chunks[1].get()},
                                {.schedule = schedule, .microbatches = m});
        Tensor x = shared_randn({2 * m, 5}, 41), y = shared_randn({2 * m, 6}, 42);
        Tensor loss = pipe.train_step(x, y, mse);
        auto reference = make();
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
        if (pipe.is_last()) CHECK(close(predicted, (*make())(x)));
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
        // the median of three steps: a descheduled rank shows up as idle time on its peers
        std::vector<double> idles;
        for (int trial = 0; trial < 3; ++trial) {
          dist::barrier();
          const auto start = std::chrono::steady_clock::now();
          pipe.train_step(x, y, mse);
          dist::barrier();
          const double wall =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          const double busy = pipe.stats().step_s - pipe.stats().waiting_s;
          idles.push_back(1.0 - busy / wall);
        }
        std::sort(idles.begin(), idles.end());
        const double idle = idles[1], expected = double(p - 1) / (m + p - 1);
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

  TEST_CASE("hybrid data x tensor parallelism equals one process step for step") {
    const int n = dist::world_size();
    const int t = n % 2 == 0 ? 2 : 1, d = n / t;
    parallel::ProcessMesh mesh({.data = d, .tensor = t});
    TensorParallelMlp sharded(13, mesh.tensor());
    ReferenceMlp reference(13);
    parallel::DistributedDataParallel ddp(*sharded.model, {.group = mesh.data()});
    optim::SGD opt(sharded.model->parameters(), {.lr = 0.1, .momentum = 0.9});
    optim::SGD ref_opt(reference.model->parameters(), {.lr = 0.1, .momentum = 0.9});
    const int64_t local = 3;
    for (int step = 0; step < 4; ++step) {
      CAPTURE(step);
      Tensor x = shared_randn({local * d, 8}, 300 + step),
             y = shared_randn({local * d, 6}, 400 + step);
      opt.zero_grad(false);
      ref_opt.zero_grad();
      const int64_t first = local * mesh.data_rank();
      mse(ddp(x.narrow(0, first, local)), y.narrow(0, first, local)).backward();
      mse((*reference.model)(x), y).backward();
      opt.step();
      ref_opt.step();
      check_state_equal(parallel::gather_state_dict(*sharded.model), reference.model->state_dict());
    }
  }
}

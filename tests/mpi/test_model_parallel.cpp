// Tensor parallelism against one process: tensor-parallel layers and the vocab-parallel loss
// against their unsharded counterparts built from the same seed, hybrid data x tensor
// parallelism step for step, and meshes (pipelines: test_pipeline.cpp).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "model_parallel_helpers.h"
#include "weave/weave.h"

using namespace weave;
using namespace weave_test;

namespace {

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
      for (int t : divisors(n / d))
        for (int c : divisors(n / (d * t))) {
          const int p = n / (d * t * c);
          CAPTURE(d);
          CAPTURE(t);
          CAPTURE(c);
          parallel::ProcessMesh mesh({.data = d, .tensor = t, .pipeline = p, .context = c});
          CHECK(mesh.data().size() == d);
          CHECK(mesh.tensor().size() == t);
          CHECK(mesh.pipeline().size() == p);
          CHECK(mesh.context().size() == c);
          CHECK(mesh.data_and_context().size() == d * c);
          const int dr = mesh.data_rank(), tr = mesh.tensor_rank(), pr = mesh.pipeline_rank(),
                    cr = mesh.context_rank();
          CHECK(mesh.rank_at(dr, tr, pr, cr) == me);
          for (int i = 0; i < t; ++i)
            CHECK(mesh.tensor().global_rank(i) == mesh.rank_at(dr, i, pr, cr));
          for (int i = 0; i < d; ++i)
            CHECK(mesh.data().global_rank(i) == mesh.rank_at(i, tr, pr, cr));
          for (int i = 0; i < p; ++i)
            CHECK(mesh.pipeline().global_rank(i) == mesh.rank_at(dr, tr, i, cr));
          for (int i = 0; i < c; ++i)
            CHECK(mesh.context().global_rank(i) == mesh.rank_at(dr, tr, pr, i));
          // Every rank names its group of each kind by the group's first rank: each group is
          // named by exactly its members.
          for (const dist::Group* g : {&mesh.data(), &mesh.tensor(), &mesh.pipeline(),
                                       &mesh.context(), &mesh.data_and_context()}) {
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

  TEST_CASE("experts spread over a sub-axis of data x context: expert and expert-data groups") {
    const int n = dist::world_size();
    for (int d : divisors(n))
      for (int c : divisors(n / d))
        for (int e : divisors(d * c)) {
          const int t = n / (d * c);
          CAPTURE(d);
          CAPTURE(c);
          CAPTURE(e);
          parallel::ProcessMesh mesh({.data = d, .tensor = t, .context = c, .expert = e});
          using parallel::Axis;
          const dist::Group& experts = mesh.expert();
          const dist::Group& replicas = mesh.group({Axis::ExpertData});
          REQUIRE(experts.size() == e);
          REQUIRE(replicas.size() == d * c / e);
          // i = context + C data numbers the data x context ranks; expert i % e, replica i / e.
          const int i = mesh.context_rank() + c * mesh.data_rank(), tr = mesh.tensor_rank();
          auto rank_of = [&](int index) { return mesh.rank_at(index / c, tr, 0, index % c); };
          CHECK(mesh.expert_rank() == i % e);
          for (int k = 0; k < e; ++k) CHECK(experts.global_rank(k) == rank_of(i / e * e + k));
          for (int j = 0; j < d * c / e; ++j)
            CHECK(replicas.global_rank(j) == rank_of(j * e + i % e));
          CHECK(mesh.group({Axis::Expert, Axis::ExpertData}).ranks() ==
                mesh.data_and_context().ranks());
          CHECK(mesh.group({Axis::Data, Axis::Tensor}).size() == d * t);
          CHECK(mesh.group({Axis::Tensor}).ranks() == mesh.tensor().ranks());
          CHECK_THROWS_WITH_AS(mesh.group({Axis::Data, Axis::Expert}),
                               doctest::Contains("mixes two ways"), Error);
          if (e > 1) CHECK(mesh.str().find("expert=" + std::to_string(e)) != std::string::npos);
        }
    CHECK_THROWS_WITH_AS(parallel::ProcessMesh({.data = n, .expert = n + 1}),
                         doctest::Contains("must divide data="), Error);
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

  TEST_CASE("a padded vocabulary: the padding rows are zero and the cuts record the real size") {
    const dist::Group tp = dist::world();
    constexpr int64_t kVocab = 7;  // padded past 7 rows at every world size but 1
    const int64_t padded = parallel::padded_vocab(kVocab, tp.size());
    // Each row of a rank's piece: zero exactly where its global index is padding.
    auto check_rows = [&](const Tensor& piece) {
      const int64_t rows = piece.size(0), start = tp.rank() * rows;
      REQUIRE(rows * tp.size() == padded);
      for (int64_t r = 0; r < rows; ++r) {
        CAPTURE(start + r);
        const double magnitude = max(abs(piece.narrow(0, r, 1))).item<double>();
        CHECK((start + r >= kVocab ? magnitude == 0 : magnitude > 0));
      }
    };
    const int64_t real = padded > kVocab ? kVocab : -1;
    manual_seed(3);
    parallel::VocabParallelEmbedding embedding(kVocab, 4, tp, nullptr, padded);
    check_rows(embedding.weight);
    CHECK(parallel::tensor_splits(embedding).at("weight").size == real);
    // The head is initialized over every padded row (as a column-parallel layer); only its
    // padding is zeroed.
    models::LlamaOptions options{
        .vocab = kVocab, .dim = 24, .layers = 1, .block = {.heads = 12, .hidden = 48}};
    models::Llama model(options, {.tensor = tp});
    check_rows(static_cast<parallel::VocabParallelHead&>(*model.head).weight);
    check_rows(model.embedding_weight());
    const auto splits = parallel::tensor_splits(model);
    CHECK(splits.at("head.weight").size == real);
    CHECK(splits.at("head.weight").axis == 0);
    // A whole state dict's vocabulary is padded with zeros on its way in.
    nn::NamedTensors whole{{"head.weight", randn({kVocab, 24})}};
    check_rows(parallel::shard_state_dict(whole, model).at(0).second);
    CHECK_THROWS_WITH_AS(parallel::pad_rows(randn({kVocab, 2}), kVocab - 1),
                         doctest::Contains("7 rows cannot be padded to 6"), Error);
    CHECK_THROWS_WITH_AS(parallel::split_parameter(randn({4, 2 * tp.size()}), 1, tp, 3),
                         doctest::Contains("split along axis 0"), Error);
  }

  TEST_CASE("sequence parallelism equals one process on the whole sequence") {
    const dist::Group tp = dist::world();
    manual_seed(21);
    parallel::SequenceParallelLayerNorm norm({6}, tp);
    // sequence first (the transformer layers' leaves cut dim 1 of [B, T, hidden] instead)
    parallel::ColumnParallelLinear column(6, 12, tp,
                                          {.sequence_parallel = true, .sequence_axis = 0});
    parallel::RowParallelLinear row(12, 6, tp, {.sequence_parallel = true, .sequence_axis = 0});
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
    const Tensor& x = x_bt;
    const Tensor& w = w_bt;

    for (bool sp : {false, true}) {
      CAPTURE(sp);
      nn::TransformerBlock block(
          dim, heads, {.hidden = hidden},
          {.linears = parallel::tensor_parallel(tp, {.sequence_parallel = sp})});
      block.to(kFloat64);
      block.load_state_dict(parallel::shard_state_dict(ref.state_dict(), block));
      check_state_equal(parallel::gather_state_dict(block), ref.state_dict(), 0);
      CHECK(block.attention->local_heads() == heads / tp.size());
      // with sequence parallelism each rank holds (and its loss covers) its slice of the
      // sequence; without, the loss is replicated and counted once
      Tensor my_x = leaf(sp ? piece(x, 1, tp) : x);
      Tensor out = block(my_x);
      const Tensor expected = ref_out.detach();
      CHECK(close(out, sp ? piece(expected, 1, tp) : expected));
      sum(out * (sp ? piece(w, 1, tp) : w)).backward();
      const Tensor expected_dx = ref_x.grad();
      CHECK(close(my_x.grad(), sp ? piece(expected_dx, 1, tp) : expected_dx));
      nn::NamedTensors grads;
      for (const auto& [name, p] : block.named_parameters()) grads.emplace_back(name, p.grad());
      check_state_equal(grads, parallel::shard_state_dict(ref_grads, block));
      CHECK(autograd::must_run_pending() == 0);
    }

    // Decoding with a KV cache on the local heads: position by position equals the whole
    // causal sequence at once.
    nn::TransformerBlock block(dim, heads, {.hidden = hidden},
                               {.linears = parallel::tensor_parallel(tp)});
    block.to(kFloat64);
    block.load_state_dict(parallel::shard_state_dict(ref.state_dict(), block));
    NoGradGuard no_grad;
    nn::KVCache cache(t);
    std::vector<Tensor> steps;
    steps.push_back(block.forward(nn::Inputs(x.narrow(1, 0, 5)), cache));
    for (int64_t i = 5; i < t; ++i)
      steps.push_back(block.forward(nn::Inputs(x.narrow(1, i, 1)), cache));
    CHECK(close(cat(steps, 1), ref_out.detach()));
  }

  // The gated MLP's gate and up rows split alike (column-parallel, one GEMM), down row-parallel:
  // built from the same seed it equals nn::GatedMLP, with and without sequence parallelism, and
  // gather_state_dict gives back the unsharded one's state.
  TEST_CASE("GatedMLP split over a tensor group equals GatedMLP") {
    const dist::Group tp = dist::world();
    const int n = tp.size();
    const int64_t dim = 10, hidden = 6 * n, t = 2 * n, b = 3;
    for (const bool sequence_parallel : {false, true}) {
      for (const auto activation : {nn::GatedActivation::SiLU, nn::GatedActivation::GELUTanh}) {
        CAPTURE(sequence_parallel);
        manual_seed(61);
        nn::GatedMLP ref(dim, hidden, {.activation = activation, .bias = true});
        manual_seed(61);
        nn::GatedMLP mlp(
            dim, hidden, {.activation = activation, .bias = true},
            {.linears = parallel::tensor_parallel(tp, {.sequence_parallel = sequence_parallel})});
        ref.to(kFloat64);
        mlp.to(kFloat64);
        check_state_equal(parallel::gather_state_dict(mlp), ref.state_dict(), 0);
        const Tensor x = shared_randn({b, t, dim}, 62), w = shared_randn({b, t, dim}, 63);
        Tensor ref_x = leaf(x);
        Tensor ref_y = ref(ref_x);
        sum(ref_y * w).backward();
        Tensor my_x = leaf(sequence_parallel ? piece(x, 1, tp) : x);
        Tensor y = mlp(my_x);
        CHECK(close(y, sequence_parallel ? piece(ref_y.detach(), 1, tp) : ref_y.detach(), 1e-12));
        sum(y * (sequence_parallel ? piece(w, 1, tp) : w)).backward();
        CHECK(close(my_x.grad(), sequence_parallel ? piece(ref_x.grad(), 1, tp) : ref_x.grad(),
                    1e-12));
        CHECK(close(mlp.gate_up.grad(), piece(ref.gate_up.grad(), 1, tp), 1e-12));
        CHECK(close(mlp.gate_up_bias.grad(), piece(ref.gate_up_bias.grad(), 1, tp), 1e-12));
        CHECK(close(mlp.down->weight.grad(), piece(ref.down->weight.grad(), 1, tp), 1e-12));
        CHECK(close(mlp.down->bias.grad(), ref.down->bias.grad(), 1e-12));
      }
    }
    if (n > 1)
      CHECK_THROWS_WITH_AS(
          nn::GatedMLP(dim, 2 * n + 1, {}, {.linears = parallel::tensor_parallel(tp)}),
          doctest::Contains("does not divide among"), Error);
  }

  TEST_CASE("MultiheadAttention and MLP split alone; bad shapes fail on every rank") {
    const dist::Group tp = dist::world();
    const int n = tp.size();
    const int64_t dim = 24, heads = 12, t = 4 * n, b = 3;
    nn::MultiheadAttention ref_attention(dim, heads);  // not causal
    nn::MLP ref_mlp(dim, 8 * n, {.tanh_gelu = true});
    nn::MultiheadAttention attention(
        dim, heads, {}, {.linears = parallel::tensor_parallel(tp, {.sequence_parallel = true})});
    nn::MLP mlp(dim, 8 * n, {.tanh_gelu = true}, {.linears = parallel::tensor_parallel(tp)});
    for (nn::Module* m :
         std::initializer_list<nn::Module*>{&ref_attention, &ref_mlp, &attention, &mlp})
      m->to(kFloat64);
    attention.load_state_dict(parallel::shard_state_dict(ref_attention.state_dict(), attention));
    mlp.load_state_dict(parallel::shard_state_dict(ref_mlp.state_dict(), mlp));
    const Tensor x_bt = shared_randn({b, t, dim}, 46), w_bt = shared_randn({b, t, dim}, 47);
    const Tensor& x = x_bt;
    const Tensor& w = w_bt;

    // sequence-parallel attention: each rank's slice of the sequence in and out
    // (each reference runs its backward first: a backward also runs the collectives that
    // earlier forwards left pending, which would consume the parallel graph's)
    Tensor ref_x = leaf(x_bt), my_x = leaf(piece(x, 1, tp));
    Tensor ref_out = ref_attention(ref_x);
    sum(ref_out * w_bt).backward();
    Tensor out = attention(my_x);
    CHECK(close(out, piece(ref_out.detach(), 1, tp)));
    sum(out * piece(w, 1, tp)).backward();
    CHECK(close(my_x.grad(), piece(ref_x.grad(), 1, tp)));
    CHECK(close(attention.qkv->weight.grad(), piece(ref_attention.qkv->weight.grad(), 0, tp)));
    CHECK(close(attention.qkv->bias.grad(), piece(ref_attention.qkv->bias.grad(), 0, tp)));
    CHECK(close(attention.out->weight.grad(), piece(ref_attention.out->weight.grad(), 1, tp)));
    CHECK(close(attention.out->bias.grad(), ref_attention.out->bias.grad()));

    // the MLP on the whole sequence, its loss replicated
    Tensor ref_h = leaf(x_bt), my_h = leaf(x);
    Tensor ref_y = ref_mlp(ref_h);
    sum(ref_y * w_bt).backward();
    Tensor y = mlp(my_h);
    CHECK(close(y, ref_y.detach()));
    sum(y * w).backward();
    CHECK(close(my_h.grad(), ref_h.grad()));
    CHECK(close(mlp.fc1->weight.grad(), piece(ref_mlp.fc1->weight.grad(), 0, tp)));
    CHECK(close(mlp.fc1->bias.grad(), piece(ref_mlp.fc1->bias.grad(), 0, tp)));
    CHECK(close(mlp.fc2->weight.grad(), piece(ref_mlp.fc2->weight.grad(), 1, tp)));
    CHECK(close(mlp.fc2->bias.grad(), ref_mlp.fc2->bias.grad()));

    // Bad input raises on every rank, before any collective (no rank is left waiting).
    if (n > 1)
      CHECK_THROWS_WITH_AS(nn::MultiheadAttention(2 * (n + 1), n + 1, {},
                                                  {.linears = parallel::tensor_parallel(tp)}),
                           doctest::Contains("heads do not divide among"), Error);
    CHECK_THROWS_WITH_AS(attention(randn({b, t, dim + 1}, {.dtype = kFloat64})),
                         doctest::Contains("expected input [B, T, 24]"), Error);
    nn::KVCache cache(8);
    CHECK_THROWS_WITH_AS(attention.forward(nn::Inputs(my_x), cache),
                         doctest::Contains("decoding with a key/value cache needs the whole "
                                           "sequence"),
                         Error);
    CHECK(autograd::must_run_pending() == 0);
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

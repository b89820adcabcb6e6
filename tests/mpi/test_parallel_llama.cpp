// The Llama layers split over ranks against models::LlamaBlock on one process, built from the same
// seed: tensor parallelism with the key/value heads split or replicated (suite model_parallel),
// and context parallelism on packed windows, ring and all-to-all (suite context_parallel); the
// whole split models with a mixture of experts in every block against the same model on one
// rank (suite experts). float64, 1e-12 relative.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>

#include "model_parallel_helpers.h"
#include "weave/weave.h"

using namespace weave;
using namespace weave_test;

namespace {

// Two windows of length t: window 0 packs three documents (positions restart in each), window 1
// one document.
struct Packed {
  Tensor positions, documents;
};
Packed packed_windows(int64_t t) {
  std::vector<int64_t> positions, documents;
  for (int64_t w = 0; w < 2; ++w)
    for (int64_t i = 0; i < t; ++i) {
      const int64_t document = w == 0 ? (i < t / 3 ? 0 : i < t / 2 ? 1 : 2) : 0;
      const int64_t start = w == 0 ? (document == 0 ? 0 : document == 1 ? t / 3 : t / 2) : 0;
      positions.push_back(i - start);
      documents.push_back(document);
    }
  return {from_vector(positions, {2, t}), from_vector(documents, {2, t})};
}

bool close12(const Tensor& got, const Tensor& expected) {
  return close(got, expected, 1e-12);
}

}  // namespace

TEST_SUITE("model_parallel") {
  TEST_CASE("LlamaBlock split equals LlamaBlock whole: key/value heads split or replicated") {
    const dist::Group tp = dist::world();
    const int n = tp.size();
    const int64_t heads = 2 * n, dim = 4 * heads, hidden = 8 * n, t = 9;
    const Packed packed = packed_windows(t);
    for (const auto& [kv_heads_case, features_case] :
         {std::pair{int64_t(n), false}, std::pair{int64_t(1), false}, std::pair{int64_t(n), true},
          std::pair{int64_t(1), true}}) {
      // copies: CAPTURE's lambda cannot take a binding
      const int64_t kv_heads = kv_heads_case;
      const bool features = features_case;  // Qwen 3's and Gemma 3's: head_dim, q/k norms, scale
      CAPTURE(kv_heads);
      CAPTURE(features);
      models::LlamaBlockOptions whole{.heads = heads, .kv_heads = kv_heads, .hidden = hidden};
      if (features)
        whole.head_dim = 6, whole.qk_norm = nn::HeadNormOptions{}, whole.attention_scale = 0.4;
      manual_seed(71);
      models::LlamaBlock ref(dim, whole);
      manual_seed(71);
      models::LlamaBlock block(dim, whole, {.tensor = tp});
      ref.to(kFloat64);
      block.to(kFloat64);
      const nn::GroupedQueryAttention &a = *block.attention, &r = *ref.attention;
      const bool replicated = kv_heads % n != 0;  // every rank holds the whole kv
      CHECK(a.kv.size(1) == (replicated ? r.kv.size(1) : r.kv.size(1) / n));
      const nn::NamedTensors gathered = parallel::gather_state_dict(block), want = ref.state_dict();
      REQUIRE(gathered.size() == want.size());
      for (size_t i = 0; i < want.size(); ++i) CHECK(close(gathered[i].second, want[i].second, 0));
      const Tensor x = shared_randn({2, t, dim}, 72), w = shared_randn({2, t, dim}, 73);
      Tensor ref_x = leaf(x), my_x = leaf(x);
      const Tensor ref_out = ref({ref_x, packed.positions, packed.documents});
      sum(ref_out * w).backward();
      const Tensor ref_y = ref_out.detach();
      Tensor y = block({my_x, packed.positions, packed.documents});
      CHECK(close12(y, ref_y));
      sum(y * w).backward();
      CHECK(close12(my_x.grad(), ref_x.grad()));
      CHECK(close12(a.q->weight.grad(), piece(r.q->weight.grad(), 0, tp)));
      CHECK(close12(a.kv.grad(), replicated ? r.kv.grad() : piece(r.kv.grad(), 1, tp)));
      CHECK(close12(a.out->weight.grad(), piece(r.out->weight.grad(), 1, tp)));
      const nn::GatedMLP &mlp = *block.mlp, &ref_mlp = *ref.mlp;
      CHECK(close12(mlp.gate_up.grad(), piece(ref_mlp.gate_up.grad(), 1, tp)));
      CHECK(close12(mlp.down->weight.grad(), piece(ref_mlp.down->weight.grad(), 1, tp)));
      CHECK(close12(block.norm1->weight.grad(), ref.norm1->weight.grad()));
      CHECK(close12(block.norm2->weight.grad(), ref.norm2->weight.grad()));
      if (features) {  // whole on every rank, each norming its heads: the gradients summed
        CHECK(close12(a.q_norm.grad(), r.q_norm.grad()));
        CHECK(close12(a.k_norm.grad(), r.k_norm.grad()));
      }
      CHECK(autograd::must_run_pending() == 0);
    }
    if (n == 4)  // 3 key/value heads neither divide among 4 ranks nor the ranks among them
      CHECK_THROWS_WITH_AS(nn::GroupedQueryAttention(24, {.heads = 12, .kv_heads = 3},
                                                     {.linears = parallel::tensor_parallel(tp)}),
                           doctest::Contains("key/value heads divide among them"), Error);
  }
}

TEST_SUITE("model_parallel") {
  // The model options' recompute_blocks, with and without experts: every block runs again in
  // backward (its pre-hook sees a second call), and the logits, the auxiliary loss and every
  // gradient are bitwise the plain run's.
  TEST_CASE("recompute_blocks runs each block again in backward and changes no gradient") {
    const dist::Group tp = dist::world();
    const int64_t vocab = 12, dim = 24;
    const Packed packed = packed_windows(7);
    Generator g(9);
    const Tensor tokens = randint(0, vocab, {2, 7}, {.dtype = kInt64}, &g);
    const Tensor targets = randint(0, vocab, {14}, {.dtype = kInt64}, &g);
    for (const bool experts : {false, true})
      for (const std::string arch : {"llama", "gpt2"}) {
        CAPTURE(experts);
        CAPTURE(arch);
        std::vector<Tensor> logits, aux, grads[2];
        for (const bool recompute : {false, true}) {
          manual_seed(41);
          const models::ModelSplit split{.tensor = tp};
          const auto moe = experts ? std::optional(nn::MoEOptions{
                                         .hidden = dim, .ffn = 16, .router = {.experts = 4}})
                                   : std::nullopt;
          std::shared_ptr<models::Llama> llama;
          std::shared_ptr<models::GPT2> gpt2;
          if (arch == "llama")
            llama = std::make_shared<models::Llama>(
                models::LlamaOptions{.vocab = vocab,
                                     .dim = dim,
                                     .layers = 2,
                                     .block = {.heads = 12, .hidden = 48, .moe = moe}},
                split);
          else
            gpt2 = std::make_shared<models::GPT2>(models::GPT2Options{.vocab = vocab,
                                                                      .dim = dim,
                                                                      .layers = 2,
                                                                      .heads = 12,
                                                                      .max_positions = 16,
                                                                      .moe = moe},
                                                  split);
          nn::CausalLM& model = llama ? static_cast<nn::CausalLM&>(*llama) : *gpt2;
          model.set_recompute_blocks(recompute);
          model.to(kFloat64);
          nn::Module& first = llama ? (*llama->blocks)[0] : (*gpt2->blocks)[0];
          int calls = 0;
          auto handle = first.register_forward_pre_hook([&](nn::Module&, const Tensor&) {
            ++calls;
            return Tensor();
          });
          const Tensor out =
              llama ? model({tokens, packed.positions, packed.documents}) : model(tokens);
          Tensor loss = parallel::vocab_parallel_cross_entropy(out.reshape({14, -1}), targets, tp);
          const Tensor extra = llama ? llama->aux_loss() : gpt2->aux_loss();
          CHECK(extra.defined() == experts);
          loss.backward();  // the blocks' balancing losses ride along
          CHECK(calls == (recompute ? 2 : 1));
          handle.remove();
          logits.push_back(out.detach());
          aux.push_back(experts ? extra.detach() : zeros({}));
          for (const Tensor& p : model.parameters()) grads[recompute].push_back(p.grad());
        }
        CHECK(equal(logits[1], logits[0]));
        CHECK(equal(aux[1], aux[0]));
        REQUIRE(grads[1].size() == grads[0].size());
        for (size_t i = 0; i < grads[0].size(); ++i) {
          CAPTURE(i);
          CHECK(equal(grads[1][i], grads[0][i]));
        }
      }
  }
}

TEST_SUITE("experts") {
  TEST_CASE("Llama and GPT2 split with experts equal the model on one rank") {
    const dist::Group tp = dist::world();
    std::vector<std::vector<int>> singletons;
    for (int r = 0; r < tp.size(); ++r) singletons.push_back({r});
    const dist::Group alone = dist::split_group(dist::world(), singletons);
    const int64_t vocab = 12, dim = 24;  // every split divides at 1 to 4 ranks
    const nn::MoEOptions experts{.hidden = dim, .ffn = 16, .router = {.experts = 4, .top_k = 2}};
    for (const std::string arch : {"llama", "gpt2"}) {
      CAPTURE(arch);
      auto build = [&](const dist::Group& group) -> std::shared_ptr<nn::CausalLM> {
        manual_seed(31);
        const models::ModelSplit split{.tensor = group};
        std::shared_ptr<nn::CausalLM> model;
        if (arch == "llama")
          model = std::make_shared<models::Llama>(
              models::LlamaOptions{.vocab = vocab,
                                   .dim = dim,
                                   .layers = 2,
                                   .block = {.heads = 12, .hidden = 48, .moe = experts}},
              split);
        else
          model = std::make_shared<models::GPT2>(models::GPT2Options{.vocab = vocab,
                                                                     .dim = dim,
                                                                     .layers = 2,
                                                                     .heads = 12,
                                                                     .max_positions = 16,
                                                                     .moe = experts},
                                                 split);
        model->to(kFloat64);
        return model;
      };
      auto aux_loss = [](const nn::CausalLM& model) { return model.aux_loss(); };
      auto split = build(tp), whole = build(alone);
      // Block i's experts are nn::MoE's from seed moe.seed + i.
      for (int64_t i = 0; i < 2; ++i) {
        CAPTURE(i);
        nn::Module& moe = arch == "llama"
                              ? *static_cast<models::LlamaBlock&>(
                                     (*static_cast<models::Llama&>(*split).blocks)[size_t(i)])
                                     .moe
                              : *static_cast<nn::TransformerBlock&>(
                                     (*static_cast<models::GPT2&>(*split).blocks)[size_t(i)])
                                     .moe;
        nn::MoEOptions options = experts;
        options.seed += uint64_t(i);
        nn::MoE reference(options);
        reference.to(kFloat64);
        const auto got = moe.state_dict(), want = reference.state_dict();
        REQUIRE(got.size() == want.size());
        for (size_t k = 0; k < got.size(); ++k) CHECK(close(got[k].second, want[k].second, 0));
      }
      Generator g(5);
      const Tensor tokens = randint(0, vocab, {2, 7}, {.dtype = kInt64}, &g);
      const Tensor targets = randint(0, vocab, {14}, {.dtype = kInt64}, &g);
      const Tensor mine = (*split)(tokens), all = (*whole)(tokens);
      CHECK(close12(mine, piece(all, 2, tp)));
      REQUIRE(aux_loss(*split).defined());
      CHECK(close12(aux_loss(*split), aux_loss(*whole)));
      // The split model adds no aux_loss(): each block's rides along with its output into
      // backward. The truth: the whole model's in eval mode (where nothing rides along), added.
      parallel::vocab_parallel_cross_entropy(mine.reshape({14, -1}), targets, tp).backward();
      whole->eval();
      const Tensor again = (*whole)(tokens);
      CHECK(close12(again, all));
      (cross_entropy(again.reshape({14, vocab}), targets) + aux_loss(*whole)).backward();
      const auto splits = parallel::tensor_splits(*split);
      const auto compared = check_split_grads(
          *split, *whole,
          [&](const std::string& name, const Tensor& want) {
            const auto cut = splits.find(name);
            return cut == splits.end() ? want : piece(want, cut->second.axis, tp);
          },
          1e-12);
      CHECK(std::any_of(compared.begin(), compared.end(), [](const std::string& name) {
        return name.find(".moe.") != std::string::npos;  // the experts' parameters are among them
      }));
    }
  }
}

TEST_SUITE("context_parallel") {
  TEST_CASE(
      "a model over a context group, its inputs cut by default: no position sees its future") {
    // The defaults agree (shard_sequence, ModelSplit::context_layout: zig-zag), so
    // changing the window's last token moves no earlier logit (cut contiguously, they leaked).
    const int n = dist::world_size();
    if (n < 2) return;
    const parallel::ProcessMesh mesh({.context = n});
    const int64_t vocab = 16, t = 8 * n;
    manual_seed(91);
    models::Llama model(
        {.vocab = vocab, .dim = 16, .layers = 2, .block = {.heads = 4, .hidden = 32}},
        {.context_group = mesh.context()});  // no tensor group: whole linears
    model.to(kFloat64);
    NoGradGuard no_grad;
    Generator g(92);
    Tensor tokens = randint(0, vocab, {2, t}, {.dtype = kInt64}, &g);
    auto logits_of = [&](const Tensor& window) {  // the whole window's, in order
      const Tensor part = parallel::shard_sequence(window, 1, mesh.context());
      return parallel::gather_sequence(model(part), 1, mesh.context());
    };
    const Tensor before = logits_of(tokens);
    std::vector<int64_t> values = tokens.to_vector<int64_t>();
    for (int64_t row = 0; row < 2; ++row) {
      int64_t& last = values[size_t(row * t + t - 1)];
      last = (last + 1) % vocab;
    }
    const Tensor after = logits_of(from_vector(values, {2, t}));
    CHECK(equal(after.narrow(1, 0, t - 1), before.narrow(1, 0, t - 1)));
    CHECK_FALSE(equal(after.narrow(1, t - 1, 1), before.narrow(1, t - 1, 1)));
  }

  TEST_CASE("a part cut in another layout, or by hand with nothing that tells, raises everywhere") {
    const int n = dist::world_size();
    if (n < 2) return;
    const parallel::ProcessMesh mesh({.context = n});
    const dist::Group& cp = mesh.context();
    const int64_t vocab = 16, t = 8 * n, chunk = t / (2 * n), r = cp.rank();
    manual_seed(91);
    models::Llama model(
        {.vocab = vocab, .dim = 16, .layers = 1, .block = {.heads = 4, .hidden = 32}},
        {.context_group = cp});  // zig-zag
    model.to(kFloat64);
    NoGradGuard no_grad;
    Generator g(93);
    const Tensor tokens = randint(0, vocab, {2, t}, {.dtype = kInt64}, &g);
    const Tensor contiguous =
        parallel::shard_sequence(tokens, 1, cp, parallel::SequenceLayout::Contiguous);
    CHECK_THROWS_WITH_AS(model(contiguous), doctest::Contains("but its input is part"), Error);
    // Cut by hand in the model's layout (chunks r and 2n - 1 - r): no record, so only the
    // whole sequence's positions of the part can tell.
    auto by_hand = [&](const Tensor& whole, int64_t axis) {
      return cat({whole.narrow(axis, r * chunk, chunk),
                  whole.narrow(axis, (2 * n - 1 - r) * chunk, chunk)},
                 axis);
    };
    const Tensor part = by_hand(tokens, 1);
    CHECK_THROWS_WITH_AS(model(part), doctest::Contains("carries no record"), Error);
    const Tensor positions = by_hand(arange(double(t), {.dtype = kInt64}), 0);
    CHECK(equal(model(nn::Inputs(part, positions, Tensor())),
                model(parallel::shard_sequence(tokens, 1, cp))));
    // Positions that run as the other layout places them raise on every rank (the last rank's
    // two chunks are adjacent either way: it learns from the others).
    const Tensor run =
        arange(double(r * 2 * chunk), double((r + 1) * 2 * chunk), 1, {.dtype = kInt64});
    CHECK_THROWS_AS(model(nn::Inputs(part, run, Tensor())), Error);
  }

  TEST_CASE("a data-parallel wrapper that leaves out the context ranks raises on every rank") {
    // Each context rank reads its part of every sequence: only an average over data x context
    // adds up the parts of the gradient (over data alone the context replicas drift apart).
    const int n = dist::world_size();
    if (n % 2 != 0) return;
    const parallel::ProcessMesh mesh({.data = n / 2, .context = 2});
    models::Llama model({.vocab = 16, .dim = 16, .layers = 1, .block = {.heads = 4, .hidden = 32}},
                        {.context_group = mesh.context()});
    CHECK_THROWS_WITH_AS(parallel::DistributedDataParallel(model, {.group = mesh.data()}),
                         doctest::Contains("hint: wrap over mesh.data_and_context()"), Error);
    CHECK_THROWS_WITH_AS(parallel::FullyShardedDataParallel(model, {.group = mesh.data()}),
                         doctest::Contains("hint: wrap over mesh.data_and_context()"), Error);
    parallel::DistributedDataParallel ddp(model, {.group = mesh.data_and_context()});
    CHECK(ddp.group().size() == n);
  }

  TEST_CASE("LlamaBlock over a context group (no tensor group) equals it on the whole window") {
    const int n = dist::world_size();
    const parallel::ProcessMesh mesh({.context = n});
    const dist::Group& cp = mesh.context();
    const int64_t heads = 2 * n, kv_heads = n, dim = 4 * heads, t = 4 * n;
    const Packed packed = packed_windows(t);
    using parallel::SequenceLayout;
    for (const bool features : {false, true})
      for (const auto mode :
           {parallel::ContextParallelMode::Ring, parallel::ContextParallelMode::AllToAll})
        for (const auto layout : {SequenceLayout::ZigZag, SequenceLayout::Contiguous}) {
          CAPTURE(int(mode));
          CAPTURE(int(layout));
          CAPTURE(features);  // Qwen 3's and Gemma 3's head_dim, q/k norms and scale
          models::LlamaBlockOptions options{.heads = heads, .kv_heads = kv_heads};
          if (features)
            options.head_dim = 6, options.qk_norm = nn::HeadNormOptions{},
            options.attention_scale = 0.3;
          manual_seed(81);
          models::LlamaBlock ref(dim, options);
          manual_seed(81);
          models::LlamaBlock block(
              dim, options, {.context_group = cp, .context_mode = mode, .context_layout = layout});
          ref.to(kFloat64);
          block.to(kFloat64);
          auto part = [&](const Tensor& whole) {
            return parallel::shard_sequence(whole, 1, cp, layout).contiguous();
          };
          const Tensor x = shared_randn({2, t, dim}, 82), w = shared_randn({2, t, dim}, 83);
          Tensor ref_x = leaf(x);
          const Tensor ref_y = ref({ref_x, packed.positions, packed.documents});
          sum(ref_y * w).backward();
          Tensor my_x = leaf(part(x));
          Tensor y = block({my_x, part(packed.positions), part(packed.documents)});
          CHECK(close12(y, part(ref_y.detach())));
          sum(y * part(w)).backward();
          CHECK(close12(my_x.grad(), part(ref_x.grad())));
          // each rank's parameter gradient covers its positions: summed, the whole window's
          const auto params = block.named_parameters();
          const auto ref_params = ref.named_parameters();
          REQUIRE(params.size() == ref_params.size());
          for (size_t i = 0; i < params.size(); ++i) {
            CAPTURE(params[i].first);
            Tensor g = params[i].second.grad().clone();
            dist::all_reduce(g, dist::ReduceOp::Sum, cp);
            CHECK(close12(g, ref_params[i].second.grad()));
          }
          // positions left out: the part's place in 0 .. T - 1 (one document); forward only, so
          // no communicating node waits for a backward that never comes
          NoGradGuard no_grad;
          Tensor plain = block(part(x));
          CHECK(close12(plain, part(ref(x).detach())));
          CHECK(autograd::must_run_pending() == 0);
        }
  }

  TEST_CASE("ModelSplit::from_mesh: this rank's split in one call, empty for data parallelism") {
    const int n = dist::world_size();
    const parallel::ProcessMesh data({.data = n});
    const models::ModelSplit replicas = models::ModelSplit::from_mesh(data);
    CHECK(!replicas.tensor);  // whole layers: the model equals one process's
    CHECK(replicas.stages == 1);
    const parallel::ProcessMesh tensor({.tensor = n});
    const models::ModelSplit split = models::ModelSplit::from_mesh(tensor, {.gather_logits = true});
    CHECK(split.tensor.has_value() == (n > 1));  // a mesh of one rank splits nothing
    if (n == 1) return;
    CHECK(split.tensor->size() == n);
    CHECK(split.gather_logits);
    CHECK(!split.context_group);
    // The model it splits equals the one split by hand, bit for bit.
    const models::LlamaOptions options{
        .vocab = 10, .dim = 24, .layers = 2, .block = {.heads = 12, .hidden = 48}};
    manual_seed(5);
    models::Llama from_mesh(options, split);
    manual_seed(5);
    models::Llama by_hand(options, {.tensor = tensor.tensor(), .gather_logits = true});
    const Tensor tokens = from_vector<int64_t>({1, 2, 3, 4, 5, 6}, {1, 6});
    {
      NoGradGuard no_grad;  // forwards alone: no communicating node left waiting for backward
      CHECK(close(from_mesh(tokens), by_hand(tokens), 0));
    }
    CHECK(autograd::must_run_pending() == 0);
    if (n % 2 == 0) {  // pipeline stages and a context group come with the mesh too
      const parallel::ProcessMesh staged({.pipeline = 2, .context = n / 2});
      const models::ModelSplit s = models::ModelSplit::from_mesh(staged);
      CHECK(s.stages == 2);
      CHECK(s.stage == staged.pipeline_rank());
      CHECK(!s.tensor);  // no tensor ranks: whole linears
      CHECK(s.context_group.has_value() == (n > 2));
    }
  }
}

// Differentiable collectives: distributed gradcheck of every op (world and groups that skip
// ranks or start with a non-zero rank, every root, every axis of a 4-D input), values against
// one process working on the stacked inputs, root-only losses, ties, and a pipeline chain.
#include <doctest/doctest.h>

#include <cmath>
#include <memory>
#include <numeric>

#include "weave/weave.h"

using namespace weave;
namespace F = weave::dist::functional;
using dist::Group;

namespace {

// Rank r's input for a test: deterministic and different per rank (no ties).
Tensor input(const Shape& shape, int global_rank, int salt = 0) {
  Generator g(uint64_t(global_rank) * 1000 + uint64_t(salt) + 17);
  return randn(shape, {.dtype = kFloat64}, &g);
}
Tensor leaf(const Shape& shape, int global_rank, int salt = 0) {
  return input(shape, global_rank, salt).requires_grad_();
}

const std::vector<Group>& groups() {
  static std::vector<Group> all = [] {
    const int n = dist::world_size();
    std::vector<int> down(n);
    std::iota(down.rbegin(), down.rend(), 0);
    std::vector<Group> g = {dist::world(), dist::new_group(down)};
    if (n >= 3) g.push_back(dist::new_group({2, 0}));
    if (n >= 4) g.push_back(dist::new_group({3, 1, 2}));
    return g;
  }();
  return all;
}

void expect_ok(const dist::DistGradcheckResult& r, const std::string& what) {
  CHECK_MESSAGE(r.ok, what, ": ", r.report);
  CHECK(r.checked > 0);
}

// A 4-D shape with size n (the group size) on `axis` and small sizes elsewhere.
Shape shape_4d(int axis, int n) {
  Shape s{2, 1, 3, 1};
  s[axis] = n;
  return s;
}

// A user's communicating op: sums x over the world in forward and its gradient in backward.
struct SumOverRanks : autograd::Function<SumOverRanks> {
  static constexpr const char* name = "SumOverRanksBackward";
  static constexpr bool communicates = true;
  static Tensor forward(autograd::FunctionContext&, const Tensor& x) {
    Tensor y = x.clone();
    dist::all_reduce(y);
    return y;
  }
  static std::vector<Tensor> backward(autograd::FunctionContext&, const std::vector<Tensor>& g) {
    Tensor dx = g[0].clone();
    dist::all_reduce(dx);
    return {dx};
  }
};

}  // namespace

TEST_SUITE("functional") {
  TEST_CASE("a custom function that communicates runs in every rank's backward") {
    // Rank 0's loss uses the sum; the others' losses ignore it. Their backward still runs the
    // node (with a zero gradient), so rank 0's all_reduce in backward has its partners:
    // L = sum(y) + sum_{r > 0} sum(x_r), so dL/dx_r = 1 + (r > 0).
    Tensor x = from_vector<double>({1, 2, 3}).requires_grad_();
    Tensor y = SumOverRanks::apply(x);
    CHECK(y.to_vector<double>()[0] == doctest::Approx(dist::world_size()));
    Tensor loss = dist::rank() == 0 ? y.sum() : x.sum();
    loss.backward();
    const double expected = dist::rank() == 0 ? 1.0 : 2.0;
    CHECK(x.grad().to_vector<double>() == std::vector<double>(3, expected));
    CHECK(autograd::must_run_pending() == 0);
  }

  TEST_CASE("all_reduce family: gradients across ranks") {
    for (const Group& g : groups()) {
      if (g.rank() < 0) continue;
      const int me = dist::rank();
      expect_ok(dist::gradcheck([&](auto& x) { return F::all_reduce_sum(x[0] * x[0], g); },
                                {leaf({2, 3}, me)}, {}, g),
                "all_reduce_sum " + g.str());
      expect_ok(dist::gradcheck([&](auto& x) { return F::all_reduce_avg(x[0].exp(), g); },
                                {leaf({4}, me)}, {}, g),
                "all_reduce_avg " + g.str());
      expect_ok(dist::gradcheck([&](auto& x) { return F::all_reduce_max(x[0], g); },
                                {leaf({3, 2}, me)}, {}, g),
                "all_reduce_max " + g.str());
      expect_ok(dist::gradcheck([&](auto& x) { return F::all_reduce_min(x[0], g); },
                                {leaf({5}, me)}, {}, g),
                "all_reduce_min " + g.str());
    }
  }

  TEST_CASE("gradcheck with no rank checking anything raises on every rank") {
    namespace F = dist::functional;
    auto reduce = [](const std::vector<Tensor>& in) { return F::all_reduce_sum(in[0]); };
    CHECK_THROWS_WITH_AS(dist::gradcheck(reduce, {randn({3}, {.dtype = kFloat64})}),
                         doctest::Contains("nothing to check"), Error);
    // With the input requiring grad on every rank the same call checks every element.
    const dist::DistGradcheckResult result =
        dist::gradcheck(reduce, {randn({3}, {.dtype = kFloat64}).requires_grad_()});
    CHECK_MESSAGE(result.ok, result.report);
    CHECK(result.checked == 3 * dist::world_size());
  }

  TEST_CASE("max and min with ties share the gradient equally") {
    const int n = dist::world_size();
    // Every rank holds [1, 2]: all tie. L = sum_r sum(y), so dL/dy = n, shared by n ranks.
    Tensor x = from_vector<double>({1, 2}).requires_grad_();
    F::all_reduce_max(x).sum().backward();
    CHECK(allclose(x.grad(), ones({2}, {.dtype = kFloat64})));
    // No ties: only the rank holding the maximum gets the whole n.
    Tensor z = full({2}, double(dist::rank()), {.dtype = kFloat64}).requires_grad_();
    F::all_reduce_max(z).sum().backward();
    CHECK(allclose(z.grad(), full({2}, dist::rank() == n - 1 ? n : 0, {.dtype = kFloat64})));
    Tensor w = full({2}, double(dist::rank() % 2), {.dtype = kFloat64}).requires_grad_();
    F::all_reduce_min(w).sum().backward();  // the even ranks tie at 0
    const int zeros_count = (n + 1) / 2;
    CHECK(allclose(w.grad(), full({2}, dist::rank() % 2 == 0 ? double(n) / zeros_count : 0.0,
                                  {.dtype = kFloat64})));
  }

  TEST_CASE("broadcast, reduce_sum, gather, scatter from every root") {
    for (const Group& g : groups()) {
      if (g.rank() < 0) continue;
      const int me = dist::rank(), n = g.size();
      for (int root = 0; root < n; ++root) {
        std::string where = fmt::format("group {} root {}", g.str(), root);
        const bool is_root = g.rank() == root;
        expect_ok(
            dist::gradcheck(
                [&](auto& x) { return F::broadcast(is_root ? x[0] : Tensor(), root, g) * 2.0; },
                {leaf({2, 2}, me)}, {}, g),
            "broadcast " + where);
        expect_ok(dist::gradcheck([&](auto& x) { return F::reduce_sum(sin(x[0]), root, g); },
                                  {leaf({3}, me)}, {}, g),
                  "reduce_sum " + where);
        for (int axis : {0, 1})
          expect_ok(dist::gradcheck([&](auto& x) { return F::gather(x[0], root, axis, g); },
                                    {leaf({2, 3}, me)}, {}, g),
                    fmt::format("gather axis {} {}", axis, where));
        for (int axis : {0, -1})
          expect_ok(
              dist::gradcheck(
                  [&](auto& x) { return F::scatter(is_root ? x[0] : Tensor(), root, axis, g); },
                  {leaf(axis == 0 ? Shape{n, 2} : Shape{2, 2 * n}, me)}, {}, g),
              fmt::format("scatter axis {} {}", axis, where));
      }
    }
  }

  TEST_CASE("all_gather, reduce_scatter_sum, all_to_all on every axis of a 4-D input") {
    for (const Group& g : groups()) {
      if (g.rank() < 0) continue;
      const int me = dist::rank(), n = g.size();
      for (int axis = 0; axis < 4; ++axis) {
        std::string where = fmt::format("axis {} group {}", axis, g.str());
        expect_ok(dist::gradcheck([&](auto& x) { return F::all_gather(x[0], axis, g); },
                                  {leaf({2, 1, 3, 1}, me)}, {}, g),
                  "all_gather " + where);
        expect_ok(dist::gradcheck([&](auto& x) { return F::reduce_scatter_sum(x[0], axis - 4, g); },
                                  {leaf(shape_4d(axis, n), me)}, {}, g),
                  "reduce_scatter_sum " + where);
      }
      for (auto axes : {std::pair{0, 1}, {1, 0}, {2, 0}, {0, 2}, {2, 3}}) {
        const int split = axes.first, concat = axes.second;  // captured below: not bindings
        Shape s{n, n, 2 * n, 1};                             // every split axis divides by n
        expect_ok(dist::gradcheck([&](auto& x) { return F::all_to_all(x[0], split, concat, g); },
                                  {leaf(s, me)}, {}, g),
                  fmt::format("all_to_all ({}, {}) group {}", split, concat, g.str()));
      }
    }
  }

  TEST_CASE("values equal one process working on the stacked inputs") {
    const Group& g = dist::world();
    const int n = g.size(), me = g.rank();
    std::vector<Tensor> all;
    for (int r = 0; r < n; ++r) all.push_back(input({n, 2 * n, 3}, r, 5));
    Tensor mine = all[me];
    CHECK(allclose(F::all_gather(mine, 1, g), cat(all, 1)));
    Tensor total = all[0];
    for (int r = 1; r < n; ++r) total = total + all[r];
    CHECK(allclose(F::all_reduce_sum(mine, g), total));
    CHECK(allclose(F::reduce_scatter_sum(mine, 1, g), total.narrow(1, me * 2, 2)));
    Tensor exchanged =
        F::all_to_all(mine, 1, 0, g);  // piece me (along 1) of every rank, stacked on 0
    std::vector<Tensor> pieces;
    for (int r = 0; r < n; ++r) pieces.push_back(all[r].narrow(1, me * 2, 2));
    CHECK(allclose(exchanged, cat(pieces, 0)));
    Tensor gathered = F::gather(mine, n - 1, 2, g);
    if (me == n - 1)
      CHECK(allclose(gathered, cat(all, 2)));
    else
      CHECK(gathered.numel() == 0);
    CHECK(allclose(F::scatter(me == 0 ? all[0] : Tensor(), 0, 1, g), all[0].narrow(1, me * 2, 2)));
    CHECK(allclose(F::broadcast(me == 0 ? all[0] : Tensor(), 0, g), all[0]));
    autograd::clear_must_run();  // these forwards record nothing (no grad), but be sure
  }

  TEST_CASE("remote_send and remote_recv around a ring") {
    for (const Group& g : groups()) {
      if (g.rank() < 0 || g.size() < 2) continue;
      const int n = g.size(), me = g.rank();
      const int next = (me + 1) % n, prev = (me + n - 1) % n;
      // Each rank sends tanh(x) on and returns what it received, scaled: gradients go around.
      expect_ok(dist::gradcheck(
                    [&](auto& x) {
                      Tensor token, got;
                      if (me % 2 == 0) {
                        token = F::remote_send(tanh(x[0]), next, g);
                        got = F::remote_recv(prev, g);
                      } else {
                        got = F::remote_recv(prev, g);
                        token = F::remote_send(tanh(x[0]), next, g);
                      }
                      return got * 3.0;
                    },
                    {leaf({2, 3}, dist::rank())}, {}, g),
                "ring " + g.str());
    }
  }

  TEST_CASE("values and gradients equal one process on the stacked inputs, for every op") {
    const Group& g = dist::world();
    const int n = g.size(), me = g.rank(), root = n - 1;
    const Shape shape{2 * n, n, 3};
    using Ranks = std::vector<Tensor>;  // one tensor per rank
    struct Op {
      std::string name;
      std::function<Tensor(const Tensor&)> distributed;  // this rank's output
      std::function<Ranks(const Ranks&)> reference;      // every rank's output from all inputs
    };
    auto total = [](const Ranks& xs) {
      Tensor t = xs[0];
      for (size_t r = 1; r < xs.size(); ++r) t = t + xs[r];
      return t;
    };
    auto each = [n](const Tensor& t) { return Ranks(n, t); };
    auto token = [](const Tensor& like) { return empty({0}, {.dtype = like.dtype()}); };
    std::vector<Op> ops = {
        {"all_reduce_sum", [&](auto& x) { return F::all_reduce_sum(x, g); },
         [&](auto& xs) { return each(total(xs)); }},
        {"all_reduce_avg", [&](auto& x) { return F::all_reduce_avg(x, g); },
         [&](auto& xs) { return each(total(xs) / double(n)); }},
        {"all_reduce_max", [&](auto& x) { return F::all_reduce_max(x, g); },
         [&](auto& xs) { return each(max(stack(xs), {0})); }},
        {"broadcast", [&](auto& x) { return F::broadcast(x, root, g); },
         [&](auto& xs) { return each(xs[root]); }},
        {"reduce_sum", [&](auto& x) { return F::reduce_sum(x, root, g); },
         [&](auto& xs) {
           Ranks out;
           for (int r = 0; r < n; ++r) out.push_back(r == root ? total(xs) : token(xs[0]));
           return out;
         }},
        {"all_gather(1)", [&](auto& x) { return F::all_gather(x, 1, g); },
         [&](auto& xs) { return each(cat(xs, 1)); }},
        {"reduce_scatter_sum(0)", [&](auto& x) { return F::reduce_scatter_sum(x, 0, g); },
         [&](auto& xs) { return chunk(total(xs), n, 0); }},
        {"gather(2)", [&](auto& x) { return F::gather(x, root, 2, g); },
         [&](auto& xs) {
           Ranks out;
           for (int r = 0; r < n; ++r) out.push_back(r == root ? cat(xs, 2) : token(xs[0]));
           return out;
         }},
        {"scatter(1)", [&](auto& x) { return F::scatter(x, root, 1, g); },
         [&](auto& xs) { return chunk(xs[root], n, 1); }},
        {"all_to_all(0, 2)", [&](auto& x) { return F::all_to_all(x, 0, 2, g); },
         [&](auto& xs) {
           Ranks out;
           for (int r = 0; r < n; ++r) {
             Ranks pieces;
             for (int j = 0; j < n; ++j) pieces.push_back(chunk(xs[j], n, 0)[r]);
             out.push_back(cat(pieces, 2));
           }
           return out;
         }},
    };
    for (const Op& op : ops) {
      // L = sum_r sum(y_r * V_r), distributed and in one process.
      auto probe = [&](int r, const Shape& s) {
        Generator gen(uint64_t(r) + 555);
        return randn(s, {.dtype = kFloat64}, &gen);
      };
      Tensor x = leaf(shape, me, 21);
      Tensor y = op.distributed(x);
      if (y.numel() > 0)
        (y * probe(me, y.shape())).sum().backward();
      else
        autograd::backward({});
      Ranks xs;
      for (int r = 0; r < n; ++r) xs.push_back(leaf(shape, r, 21));
      Ranks ys = op.reference(xs);
      Tensor loss = zeros({}, {.dtype = kFloat64});
      for (int r = 0; r < n; ++r)
        if (ys[r].numel() > 0) loss = loss + (ys[r] * probe(r, ys[r].shape())).sum();
      loss.backward();
      CHECK_MESSAGE(y.shape() == ys[me].shape(), op.name);
      if (y.numel() > 0) CHECK_MESSAGE(allclose(y, ys[me], 1e-12, 1e-12), op.name, " values");
      // An input the objective does not use (a non-root input of broadcast or scatter) gets zero.
      Tensor expected = xs[me].grad().defined() ? xs[me].grad() : zeros_like(xs[me]);
      REQUIRE_MESSAGE(x.grad().defined(), op.name, " produced no gradient");
      CHECK_MESSAGE(allclose(x.grad(), expected, 1e-10, 1e-12), op.name, " gradients");
    }
  }

  TEST_CASE("only the root has a loss after reduce_sum and gather") {
    const int n = dist::world_size(), me = dist::rank();
    const int root = n - 1;
    Tensor x = leaf({3}, me, 9);
    Tensor y = F::reduce_sum(x * x, root);
    if (me == root)
      y.sum().backward();
    else
      autograd::backward({});  // no loss here: runs the pending collective's backward
    CHECK(allclose(x.grad(), x.detach() * 2.0));  // dL/dx_r = 2 x_r with L = sum(sum_r x_r^2)
    Tensor z = leaf({2}, me, 3);
    Tensor all = F::gather(z.exp(), 0, 0);
    if (me == 0)
      (all * 3.0).sum().backward();
    else
      autograd::backward({});
    CHECK(allclose(z.grad(), z.detach().exp() * 3.0));
    CHECK(autograd::must_run_pending() == 0);
  }

  TEST_CASE("region mappings follow the replicated-loss convention") {
    const Group& g = dist::world();
    const int n = g.size(), me = g.rank();
    // Column-parallel then row-parallel linear: the same loss on every rank, counted once.
    Tensor x = input({4, 3}, 0, 1).requires_grad_();  // replicated input
    Tensor w1 = input({3, 2 * n}, 0, 2), w2 = input({2 * n, 5}, 0, 3);
    Tensor w1_shard = w1.narrow(1, me * 2, 2).contiguous().requires_grad_();
    Tensor w2_shard = w2.narrow(0, me * 2, 2).contiguous().requires_grad_();
    Tensor h = tanh(matmul(F::copy_to_group(x, g), w1_shard));
    Tensor y = F::reduce_from_group(matmul(h, w2_shard), g);
    y.sum().backward();
    Tensor xr = x.detach().requires_grad_(), w1r = w1.requires_grad_(), w2r = w2.requires_grad_();
    matmul(tanh(matmul(xr, w1r)), w2r).sum().backward();
    CHECK(allclose(y, matmul(tanh(matmul(x.detach(), w1.detach())), w2.detach())));
    CHECK(allclose(x.grad(), xr.grad()));
    CHECK(allclose(w1_shard.grad(), w1r.grad().narrow(1, me * 2, 2)));
    CHECK(allclose(w2_shard.grad(), w2r.grad().narrow(0, me * 2, 2)));
    // scatter_to_group / gather_from_group and the sequence-parallel pair round-trip.
    Tensor full_t = input({3, 2 * n}, 0, 4).requires_grad_();
    Tensor back = F::gather_from_group(F::scatter_to_group(full_t, -1, g), -1, g);
    CHECK(allclose(back, full_t.detach()));
    (back * back).sum().backward();
    CHECK(allclose(full_t.grad(), full_t.detach() * 2.0));
    Tensor seq = input({2 * n, 3}, me, 6).requires_grad_();
    Tensor rs = F::reduce_scatter_to_sequence_group(F::gather_from_sequence_group(seq, 0, g), 0, g);
    CHECK(rs.shape() == seq.shape());
    rs.sum().backward();
    CHECK(
        allclose(seq.grad(), full({2 * n, 3}, double(n), {.dtype = kFloat64})));  // rs_r = n seq_r
  }

  TEST_CASE("pipeline chain matches the same chain in one process") {
    const int n = dist::world_size(), me = dist::rank();
    if (n < 2) return;
    auto make_layer = [](int r) {
      manual_seed(100 + r);
      auto layer = std::make_shared<nn::Linear>(2 * r + 2, 2 * r + 4);
      layer->to(kFloat64);
      return layer;
    };
    Tensor batch = input({3, 2}, 0, 8);
    // Distributed: rank r holds layer r, receives from r - 1, sends to r + 1.
    auto mine = make_layer(me);
    Tensor h = me == 0 ? batch : F::remote_recv(me - 1);
    Tensor out = (*mine)(h);
    if (me < n - 1) {
      F::remote_send(out, me + 1);
      autograd::backward({});
    } else {
      out.mean().backward();
    }
    // Reference: the whole chain here.
    std::vector<std::shared_ptr<nn::Linear>> chain;
    for (int r = 0; r < n; ++r) chain.push_back(make_layer(r));
    Tensor ref = batch;
    for (auto& layer : chain) ref = (*layer)(ref);
    ref.mean().backward();
    CHECK(allclose(mine->weight.grad(), chain[me]->weight.grad(), 1e-9, 1e-12));
    CHECK(allclose(mine->bias.grad(), chain[me]->bias.grad(), 1e-9, 1e-12));
    optim::SGD a({mine->weight, mine->bias}, {.lr = 0.1}), b(chain[me]->parameters(), {.lr = 0.1});
    a.step();
    b.step();
    CHECK(allclose(mine->weight, chain[me]->weight, 1e-12, 1e-12));
  }

  TEST_CASE("an interleaved schedule with explicit tokens equals one batch") {
    const int n = dist::world_size(), me = dist::rank();
    if (n < 2) return;
    manual_seed(7 + me);
    nn::Linear layer(3, 3);
    layer.to(kFloat64);
    auto stage = [&](const Tensor& micro) {  // returns (loss or token)
      Tensor h = me == 0 ? micro : F::remote_recv(me - 1);
      Tensor y = tanh(layer(h));
      return me < n - 1 ? F::remote_send(y, me + 1) : y.sum();
    };
    Tensor data = input({4, 3}, 0, 11);
    // Two micro-batches forward, then their backwards in order, each with explicit roots.
    Tensor first = stage(data.narrow(0, 0, 2)), second = stage(data.narrow(0, 2, 2));
    autograd::backward({first}, {}, false, false);
    autograd::backward({second}, {}, false, false);
    Tensor w_grad = layer.weight.grad().clone();
    layer.zero_grad();
    // The same data as one batch.
    Tensor whole = stage(data);
    autograd::backward({whole}, {}, false, false);
    CHECK(allclose(w_grad, layer.weight.grad(), 1e-9, 1e-12));
    CHECK(autograd::must_run_pending() == 0);
  }

  TEST_CASE("clip_grad_norm_ over a group equals clipping the whole model in one process") {
    const int n = dist::world_size(), r = dist::rank();
    for (double norm_type : {2.0, 1.0, 3.0, double(INFINITY)}) {
      CAPTURE(norm_type);
      // Rank j's shard gradient is input({5}, j); the replicated gradient is the same on all.
      auto shard_grad = [](int j) { return input({5}, j, 1) * double(j + 1); };
      Tensor replicated_grad = input({3}, 0, 2) * 10.0;
      Tensor shard = zeros({5}, {.dtype = kFloat64}).requires_grad_();
      Tensor replicated = zeros({3}, {.dtype = kFloat64}).requires_grad_();
      shard.set_grad(shard_grad(r).clone());
      replicated.set_grad(replicated_grad.clone());

      // The reference: every shard once and the replicated parameter once, in one process.
      std::vector<Tensor> whole;
      for (int j = 0; j < n; ++j) {
        whole.push_back(zeros({5}, {.dtype = kFloat64}).requires_grad_());
        whole.back().set_grad(shard_grad(j).clone());
      }
      whole.push_back(zeros({3}, {.dtype = kFloat64}).requires_grad_());
      whole.back().set_grad(replicated_grad.clone());
      const double max_norm = 0.5;
      const double expected = optim::clip_grad_norm_(whole, max_norm, norm_type);

      const double total =
          dist::clip_grad_norm_({shard}, {replicated}, max_norm, dist::world(), norm_type);
      CHECK(total == doctest::Approx(expected).epsilon(1e-12));
      CHECK(allclose(shard.grad(), whole[r].grad(), 1e-12, 1e-14));
      CHECK(allclose(replicated.grad(), whole[n].grad(), 1e-12, 1e-14));
    }
  }

  TEST_CASE("a collective's output dropped without backward is freed") {
    // all_reduce_max/min save their output; the engine keeps their nodes for the next
    // backward, but the nodes must not keep the outputs alive.
    if (dist::world_size() < 2) return;  // a world of one records no collective node
    autograd::clear_must_run();
    Tensor x = leaf({4}, dist::rank());
    for (auto op : {&F::all_reduce_max, &F::all_reduce_min}) {
      std::weak_ptr<TensorImpl> output;
      {
        Tensor y = op(x, dist::world());
        output = y.impl_ptr();
      }
      CHECK(output.expired());
    }
    CHECK(autograd::must_run_pending() == 2);
    autograd::backward({});  // every rank runs the two backwards with zero gradient
    CHECK(autograd::must_run_pending() == 0);
    CHECK(allclose(x.grad(), zeros({4}, {.dtype = kFloat64})));
  }

  TEST_CASE("evaluation forwards leave nothing pending under ForwardOnlyGuard") {
    autograd::clear_must_run();
    const size_t marks = dist::world_size() > 1 ? 1 : 0;  // a world of one communicates nothing
    Tensor x = leaf({3}, dist::rank());
    Tensor training = F::all_reduce_sum(x * 2.0);  // a training forward, still pending
    REQUIRE(autograd::must_run_pending() == marks);
    {
      autograd::ForwardOnlyGuard forward_only;
      for (int batch = 0; batch < 5; ++batch) {
        Tensor y = F::all_reduce_sum(x);
        CHECK(y.requires_grad());  // still recorded...
      }
      CHECK(autograd::must_run_pending() == 6 * marks);
    }
    CHECK(autograd::must_run_pending() == marks);  // ...but forgotten; the training node stays
    training.sum().backward();
    CHECK(autograd::must_run_pending() == 0);
    // d/dx of sum over ranks of sum(all_reduce_sum(2x)) is 2n.
    CHECK(allclose(x.grad(), full({3}, 2.0 * dist::world_size(), {.dtype = kFloat64})));
  }

  TEST_CASE("no graph under NoGradGuard; bad axes and sizes are errors") {
    const int n = dist::world_size();
    {
      NoGradGuard no_grad;
      Tensor y = F::all_reduce_sum(leaf({2}, 0));
      CHECK(y.grad_fn() == nullptr);
      CHECK(autograd::must_run_pending() == 0);
    }
    if (n >= 2) {
      std::string message;
      try {
        F::reduce_scatter_sum(ones({3, n + 1}), 1);
      } catch (const Error& e) {
        message = e.what();
      }
      CHECK(message.find("[reduce_scatter_sum] axis 1 has size") == 0);
      CHECK(message.find(fmt::format("among the {} ranks", n)) != std::string::npos);
    }
    std::string axis_message;
    try {
      F::all_gather(ones({2, 2}), 2);
    } catch (const Error& e) {
      axis_message = e.what();
    }
    CHECK(axis_message.find("[all_gather] dimension 2 out of range") == 0);
  }
}

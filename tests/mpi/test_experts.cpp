// Expert parallelism against the dense layer: each rank's tokens through ExpertParallelMoE give
// what nn::MoE gives them (values, the auxiliary loss, dropped counts), and every expert's
// gradient equals the dense expert's gradient summed over every rank's tokens; with and
// without dropped tokens; bad options raise on every rank.
#include <doctest/doctest.h>

#include <vector>

#include "helpers.h"
#include "weave/weave.h"

using namespace weave;

namespace {

Tensor tokens_of(int rank, uint64_t salt = 0) {
  Generator g(uint64_t(rank) * 31 + salt + 1);
  return randn({7, 4}, {.dtype = kFloat64}, &g);
}

nn::MoEOptions options(int64_t experts, double capacity_factor) {
  return {.hidden = 4,
          .ffn = 5,
          .router = {.experts = experts,
                     .top_k = 2,
                     .capacity_factor = capacity_factor,
                     .aux_loss_coef = 0.1,
                     .z_loss_coef = 0.01},
          .seed = 11};
}

bool near(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined();
  return test::close(a, b, 1e-11, 1e-13);
}

}  // namespace

TEST_SUITE("experts") {
  TEST_CASE("expert-parallel MoE equals the dense layer: values, aux loss, gradients") {
    const int n = dist::world_size(), me = dist::rank();
    for (double capacity : {0.0, 0.5}) {
      CAPTURE(capacity);
      const nn::MoEOptions o = options(2 * n, capacity);
      // One process: every rank's tokens through the dense layer, the objective summed.
      nn::MoE dense(o);
      dense.to(kFloat64);
      Tensor objective = zeros({}, {.dtype = kFloat64});
      Tensor expected, expected_aux;
      int64_t expected_dropped = 0;
      for (int r = 0; r < n; ++r) {
        Tensor y = dense(tokens_of(r));
        objective = objective + (y * tokens_of(r, 100)).sum() + dense.aux_loss();
        if (r == me) {
          expected = y.detach();
          expected_aux = dense.aux_loss().detach();
          expected_dropped = dense.stats().dropped;
        }
      }
      objective.backward();

      parallel::ExpertParallelMoE moe(o, dist::world());
      moe.to(kFloat64);
      Tensor y = moe(tokens_of(me));
      CHECK(near(y, expected));
      CHECK(near(moe.aux_loss(), expected_aux));
      CHECK(moe.stats().dropped == expected_dropped);
      CHECK((capacity == 0) == (expected_dropped == 0));  // 0.5 always drops some here
      ((y * tokens_of(me, 100)).sum() + moe.aux_loss()).backward();
      for (int64_t le = 0; le < moe.local_experts(); ++le) {
        const auto mine = moe.expert(moe.first_expert() + le).parameters();
        const auto reference = dense.expert(moe.first_expert() + le).parameters();
        for (size_t i = 0; i < mine.size(); ++i) {
          CAPTURE(le);
          CAPTURE(i);
          CHECK(near(mine[i].grad(), reference[i].grad()));
        }
      }
      // The router is replicated: its gradients summed over the ranks are the dense one's.
      Tensor router_grad = moe.router().weight.grad().clone();
      dist::all_reduce(router_grad);
      CHECK(near(router_grad, dense.router().weight.grad()));
    }
  }

  TEST_CASE(
      "with global load balancing the ranks together equal one process on the stacked batch") {
    const int n = dist::world_size(), me = dist::rank();
    const nn::MoEOptions o = options(2 * n, 0);
    std::vector<Tensor> batches;
    for (int r = 0; r < n; ++r) batches.push_back(tokens_of(r));
    nn::MoE dense(o);
    dense.to(kFloat64);
    const Tensor y = dense(cat(batches));
    // sum_r aux_r = n aux(stacked): each rank's shares are the stacked batch's.
    const std::vector<Tensor> weights(size_t(n), tokens_of(0, 200));
    ((y * cat(weights)).sum() + dense.aux_loss() * double(n)).backward();

    nn::MoEOptions balanced = o;
    balanced.reduce_shares = parallel::shares_over(dist::world());
    parallel::ExpertParallelMoE moe(balanced, dist::world());
    moe.to(kFloat64);
    const Tensor mine = moe(tokens_of(me));
    CHECK(near(mine, y.detach().narrow(0, 7 * me, 7)));
    Tensor aux = moe.aux_loss().detach().reshape({1}).clone();
    dist::all_reduce(aux, dist::ReduceOp::Avg);
    CHECK(near(aux.reshape({}), dense.aux_loss().detach()));
    ((mine * tokens_of(0, 200)).sum() + moe.aux_loss()).backward();
    for (int64_t le = 0; le < moe.local_experts(); ++le) {
      const auto p = moe.expert(moe.first_expert() + le).parameters();
      const auto q = dense.expert(moe.first_expert() + le).parameters();
      for (size_t i = 0; i < p.size(); ++i) CHECK(near(p[i].grad(), q[i].grad()));
    }
    Tensor router_grad = moe.router().weight.grad().clone();
    dist::all_reduce(router_grad);
    CHECK(near(router_grad, dense.router().weight.grad()));
  }

  TEST_CASE("the distributed gradcheck passes through dispatch and combine") {
    const int n = dist::world_size(), me = dist::rank();
    parallel::ExpertParallelMoE moe(options(2 * n, 0.75), dist::world());
    moe.to(kFloat64);
    Tensor x = tokens_of(me).narrow(0, 0, 3).contiguous().requires_grad_();
    auto result = dist::gradcheck([&](const std::vector<Tensor>& in) { return moe(in[0]); }, {x});
    CHECK_MESSAGE(result.ok, result.report);
  }

  TEST_CASE("bad options raise on every rank") {
    const int n = dist::world_size();
    if (n > 1)
      CHECK_WEAVE_ERROR(parallel::ExpertParallelMoE(options(2 * n + 1, 0), dist::world()),
                        "ExpertParallelMoE", "do not divide");
    nn::MoEOptions too_many = options(2 * n, 0);
    too_many.router.top_k = 2 * n + 1;
    const std::string error =
        test::error_of([&] { parallel::ExpertParallelMoE(too_many, dist::world()); });
    CHECK_MESSAGE(error.find("must be from 1 to the number of experts") != std::string::npos,
                  error);
    // Any of the router's options differing on rank 0: every rank raises, naming it.
    if (n > 1) {
      const bool first = dist::rank() == 0;
      for (int which = 0; which < 5; ++which) {
        nn::MoEOptions o = options(2 * n, 0);
        if (first && which == 0) o.router.gate = nn::Gate::Sigmoid;
        if (first && which == 1) o.router.renormalize = false;
        if (first && which == 2) o.router.capacity_factor = 1.5;
        if (first && which == 3) o.router.aux_loss_coef = 0.2;
        if (first && which == 4) o.router.z_loss_coef = 0.02;
        const char* names[] = {"gate", "renormalize", "capacity_factor", "aux_loss_coef",
                               "z_loss_coef"};
        CAPTURE(names[which]);
        const std::string differs =
            test::error_of([&] { parallel::ExpertParallelMoE(o, dist::world()); });
        CHECK_MESSAGE(differs.find("disagree on the router's options") != std::string::npos,
                      differs);
        CHECK_MESSAGE(differs.find(names[which]) != std::string::npos, differs);
      }
    }
    // Still in step.
    parallel::ExpertParallelMoE moe(options(2 * n, 0), dist::world());
    CHECK(moe(tokens_of(0)).shape() == Shape{7, 4});
  }

  TEST_CASE("ZeRO-1, DistributedOptimizer and decentralized training refuse spread experts") {
    // They average every parameter over their group: each rank's experts are others', so the
    // average would mix different experts. Every rank raises, naming DDP and FSDP.
    if (dist::world_size() < 2) return;
    parallel::ExpertParallelMoE moe(options(2 * dist::world_size(), 0), dist::world());
    const auto factory = [](std::vector<Tensor> params) {
      return std::make_unique<optim::SGD>(std::move(params), optim::SGDOptions{.lr = 0.1});
    };
    CHECK_WEAVE_ERROR(parallel::ZeroRedundancyOptimizer(moe.parameters(), factory),
                      "ZeroRedundancyOptimizer", "one of the experts spread");
    optim::SGD sgd(moe.parameters(), {.lr = 0.1});
    CHECK_WEAVE_ERROR(parallel::DistributedOptimizer(sgd), "DistributedOptimizer",
                      "FullyShardedDataParallel");
    CHECK_WEAVE_ERROR(parallel::DecentralizedDataParallel(moe, factory, {.topology = "complete"}),
                      "DecentralizedDataParallel", "one of the experts spread");
    // Still in step.
    CHECK(moe(tokens_of(0)).shape() == Shape{7, 4});
  }

  TEST_CASE("inside join() every rank raises at the first forward, and the group stays usable") {
    if (dist::world_size() < 2) return;
    parallel::ExpertParallelMoE moe(options(2 * dist::world_size(), 0), dist::world());
    // A wrapper join() can shadow, over the same ranks: a one-parameter DDP.
    nn::Linear scale(4, 4);
    scale.to(kFloat64);
    parallel::DistributedDataParallel ddp(scale);
    const std::string error = test::error_of([&] {
      parallel::join({ddp}, [&] {
        for (int step = 0; step < 2; ++step)
          moe.forward(ddp(tokens_of(dist::rank()))).sum().backward();
      });
    });
    CHECK_MESSAGE(error.find("cannot run inside parallel::join()") != std::string::npos, error);
    Tensor out = moe.forward(tokens_of(dist::rank()));  // outside join() it runs
    CHECK(out.shape() == Shape{7, 4});
  }
}

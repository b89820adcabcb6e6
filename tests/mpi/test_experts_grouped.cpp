// The experts as grouped GEMMs under expert parallelism against the loop over experts (values
// and every gradient, with and without drops), and the selection bias balancing a skewed router
// over the ranks: each rank its share of the batch, the loads counted over all of them, equal
// step by step to one process on the stacked batch (float64); the bias through a sharded
// checkpoint.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <vector>

#include "helpers.h"
#include "weave/weave.h"

using namespace weave;

namespace {

Tensor batch_of(int rank, int64_t rows, uint64_t salt) {
  Generator g(uint64_t(rank) * 131 + salt + 1);
  Tensor x = randn({rows, 8}, {.dtype = kFloat64}, &g);
  NoGradGuard no_grad;
  x.narrow(1, 0, 1).fill_(4.0);  // the skewed router weighs this feature
  return x;
}

nn::MoEOptions balanced_options(int64_t experts) {
  return {.hidden = 8,
          .ffn = 6,
          .router = {.experts = experts,
                     .top_k = 2,
                     .gate = nn::Gate::Sigmoid,
                     .aux_loss_coef = 0,
                     .bias_update_rate = 0.01},
          .seed = 2,
          .gated = true};
}

void skew(nn::MoE& moe) {
  NoGradGuard no_grad;
  moe.router().weight.narrow(0, 0, 1).narrow(1, 0, 1).fill_(0.5);
}

double max_over_mean(const std::vector<double>& load) {
  double total = 0;
  for (double l : load) total += l;
  return *std::max_element(load.begin(), load.end()) * double(load.size()) / total;
}

}  // namespace

TEST_SUITE("experts_grouped") {
  TEST_CASE("grouped experts over the ranks equal the loop over them, values and gradients") {
    const int n = dist::world_size(), me = dist::rank();
    for (const double capacity : {0.0, 0.5}) {
      CAPTURE(capacity);
      nn::MoEOptions o{.hidden = 8,
                       .ffn = 5,
                       .router = {.experts = 4 * n, .top_k = 3, .capacity_factor = capacity},
                       .seed = 7,
                       .gated = true,
                       .shared_ffn = 4};
      parallel::ExpertParallelMoE grouped(o, dist::world());
      o.grouped = false;
      parallel::ExpertParallelMoE loop(o, dist::world());
      grouped.to(kFloat64);
      loop.to(kFloat64);
      const Tensor x = batch_of(me, 9, 3), w = batch_of(me, 9, 4);
      std::vector<std::vector<Tensor>> grads(2);
      std::vector<Tensor> ys;
      for (nn::MoE* moe : {static_cast<nn::MoE*>(&grouped), static_cast<nn::MoE*>(&loop)}) {
        const Tensor input = x.detach().requires_grad_();
        const Tensor y = (*moe)(input);
        ((y * w).sum() + moe->aux_loss()).backward();
        ys.push_back(y.detach());
        auto& mine = grads[ys.size() - 1];
        mine.push_back(input.grad());
        for (const Tensor& p : moe->parameters()) mine.push_back(p.grad());
      }
      CHECK(test::close(ys[0], ys[1], 1e-12, 1e-14));
      REQUIRE(grads[0].size() == grads[1].size());
      for (size_t i = 0; i < grads[0].size(); ++i) {
        CAPTURE(i);
        CHECK(test::close(grads[0][i], grads[1][i], 1e-12, 1e-14));
      }
      CHECK((capacity > 0) == (grouped.stats().dropped > 0));
    }
  }

  TEST_CASE("bias balancing over the ranks equals one process on the stacked batch") {
    const int n = dist::world_size(), me = dist::rank();
    const int64_t experts = 8 % n == 0 ? 8 : 6, rows = 1024 / n;
    // One process: every rank's share stacked.
    nn::MoE whole(balanced_options(experts));
    whole.to(kFloat64);
    skew(whole);
    optim::SGD whole_sgd(whole.parameters(), {.lr = 0.01});
    // The ranks: the experts spread over them, the router replicated (its gradient summed), the
    // loads counted over every rank.
    nn::MoEOptions spread_options = balanced_options(experts);
    spread_options.reduce_shares = parallel::shares_over(dist::world());
    parallel::ExpertParallelMoE spread(spread_options, dist::world());
    spread.to(kFloat64);
    skew(spread);
    optim::SGD spread_sgd(spread.parameters(), {.lr = 0.01});
    std::vector<double> ratio;
    for (int step = 0; step < 50; ++step) {
      std::vector<Tensor> shares;
      for (int r = 0; r < n; ++r) shares.push_back(batch_of(r, rows, uint64_t(step) * 7));
      const Tensor all = cat(shares);
      whole_sgd.zero_grad();
      mse_loss(whole(all), all * 0.5).backward();
      whole_sgd.step();
      nn::update_expert_biases(whole);

      spread_sgd.zero_grad();
      const Tensor mine = shares[size_t(me)];
      (mse_loss(spread(mine), mine * 0.5) * (1.0 / n)).backward();
      dist::all_reduce(spread.router().weight.grad());
      spread_sgd.step();
      nn::update_expert_biases(spread);

      CAPTURE(step);
      REQUIRE(equal(spread.router().expert_bias(), whole.router().expert_bias()));
      Tensor load =
          from_vector(std::vector<double>(spread.stats().load.begin(), spread.stats().load.end()));
      dist::all_reduce(load);
      const std::vector<int64_t>& reference = whole.stats().load;
      REQUIRE(load.to_vector<double>() == std::vector<double>(reference.begin(), reference.end()));
      ratio.push_back(max_over_mean(load.to_vector<double>()));
    }
    CHECK(ratio.front() > 2.5);
    if (experts == 8)  // the unit suite's case: within 20% of the mean before step 50
      CHECK(std::find_if(ratio.begin(), ratio.end(), [](double r) { return r <= 1.2; }) !=
            ratio.end());
    CHECK(test::close(spread.router().weight, whole.router().weight, 1e-12, 1e-14));

    // The bias through a sharded checkpoint, into a layer built anew.
    const std::string dir = test::shared_dir("expert_bias");
    parallel::save_sharded_checkpoint(dir, {.model = &spread});
    parallel::ExpertParallelMoE restored(spread_options, dist::world());
    restored.to(kFloat64);
    CHECK(!equal(restored.router().expert_bias(), spread.router().expert_bias()));
    data::TrainingState state{.model = &restored};
    parallel::load_sharded_checkpoint(dir, state);
    CHECK(equal(restored.router().expert_bias(), spread.router().expert_bias()));
    dist::barrier();
    if (me == 0) std::filesystem::remove_all(dir);
  }

  TEST_CASE("a selection bias over an expert group needs the loads of every balancing rank") {
    if (dist::world_size() < 2) return;
    CHECK_WEAVE_ERROR(
        parallel::ExpertParallelMoE(balanced_options(2 * dist::world_size()), dist::world()),
        "ExpertParallelMoE", "needs the loads of every rank that balances");
  }
}

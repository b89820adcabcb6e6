// HSDP: FSDP over shard groups of 2 ranks, each shard's gradient averaged over its replicas in
// the other shard groups, equals DDP over the world (float64, 20 AdamW steps); its sharded
// checkpoint loads under FSDP over the world and under DDP with the next step equal. The same
// built by parallel::data_parallel from a mesh (a pass-through on one replica).
#include <doctest/doctest.h>

#include <filesystem>
#include <string>

#include "fsdp_helpers.h"
#include "weave/weave.h"

using namespace weave;
using namespace weave::test::fsdp;
using parallel::DistributedDataParallel;
using parallel::FullyShardedDataParallel;

namespace {

// Shard groups {0, 1}, {2, 3}, ...; replicate groups of the ranks with the same place in theirs.
struct Hybrid {
  dist::Group shard, replicate;
};
Hybrid hybrid_groups() {
  const int n = dist::world_size();
  std::vector<std::vector<int>> shards, replicas(2);
  for (int r = 0; r < n; r += 2) shards.push_back({r, r + 1});
  for (int r = 0; r < n; ++r) replicas[size_t(r % 2)].push_back(r);
  return {dist::split_group(dist::world(), shards), dist::split_group(dist::world(), replicas)};
}

}  // namespace

TEST_SUITE("fsdp") {
  TEST_CASE("HSDP (shard 2 x replicate N/2) equals DDP; its checkpoint loads at FSDP N and DDP") {
    const int n = dist::world_size();
    if (n % 2 != 0) return;
    const Hybrid groups = hybrid_groups();
    auto reference = make_model(100), model = make_model(100 + uint64_t(dist::rank()));
    DistributedDataParallel ddp(*reference);
    optim::AdamW reference_opt(reference->parameters(), adamw_options());
    FullyShardedDataParallel hsdp(*model,
                                  {.group = groups.shard, .replicate_group = groups.replicate});
    optim::AdamW opt(hsdp.parameters(), adamw_options());
    // Rank 0's model reached every replica: the shard groups broadcast, then the replicas.
    CHECK(max_difference(*reference, hsdp) == 0);
    auto step_both = [&](int step) {
      auto [x, y] = local_batch(step);
      reference_opt.zero_grad();
      opt.zero_grad();
      mse_loss(ddp(x), y).backward();
      mse_loss(hsdp(x), y).backward();
      CHECK(hsdp.clip_grad_norm_(0.5) ==
            doctest::Approx(optim::clip_grad_norm_(reference->parameters(), 0.5)).epsilon(1e-12));
      reference_opt.step();
      opt.step();
    };
    for (int step = 0; step < 20; ++step) step_both(step);
    CHECK(max_difference(*reference, hsdp) <= 1e-10);
    CHECK(hsdp.stats().failed_steps == 0);

    // Its sharded checkpoint (each shard saved by the ranks that hold it) loads under FSDP over
    // the world and under DDP; the next step equals HSDP's.
    const std::string dir =
        (std::filesystem::temp_directory_path() / "weave_hsdp_checkpoint").string();
    data::TrainingState state{.model = &hsdp.sharded_module(), .optimizer = &opt};
    parallel::save_sharded_checkpoint(dir, state);
    auto flat_model = make_model(5), ddp_model = make_model(6);
    FullyShardedDataParallel fsdp(*flat_model);
    optim::AdamW fsdp_opt(fsdp.parameters(), adamw_options());
    data::TrainingState into_fsdp{.model = &fsdp.sharded_module(), .optimizer = &fsdp_opt};
    parallel::load_sharded_checkpoint(dir, into_fsdp);
    DistributedDataParallel ddp_again(*ddp_model);
    optim::AdamW ddp_opt(ddp_model->parameters(), adamw_options());
    data::TrainingState into_ddp{.model = ddp_model.get(), .optimizer = &ddp_opt};
    parallel::load_sharded_checkpoint(dir, into_ddp);
    auto [x, y] = local_batch(99);
    for (optim::Optimizer* o : std::initializer_list<optim::Optimizer*>{&opt, &fsdp_opt, &ddp_opt})
      o->zero_grad();
    mse_loss(hsdp(x), y).backward();
    mse_loss(fsdp(x), y).backward();
    mse_loss(ddp_again(x), y).backward();
    opt.step();
    fsdp_opt.step();
    ddp_opt.step();
    CHECK(max_difference(*ddp_model, hsdp) <= 1e-12);
    CHECK(max_difference(*ddp_model, fsdp) <= 1e-12);
    dist::barrier();
    if (dist::rank() == 0) std::filesystem::remove_all(dir);
  }

  TEST_CASE("ProcessMesh's replicate x shard split gives HSDP's groups") {
    const int n = dist::world_size();
    if (n % 2 != 0) return;
    const Hybrid groups = hybrid_groups();
    parallel::ProcessMesh mesh({.data = n, .replicate = n / 2});
    CHECK(mesh.shard().ranks() == groups.shard.ranks());
    CHECK(mesh.replicate().ranks() == groups.replicate.ranks());
    // With tensor-parallel pairs: shard and replicate over the data axis of one tensor rank.
    if (n == 8) {  // rank r: tensor t = r % 2, data d = r / 2 (shard d % 2, replica d / 2)
      parallel::ProcessMesh split({.data = 4, .tensor = 2, .replicate = 2});
      const int t = dist::rank() % 2, d = dist::rank() / 2, first = d / 2 * 2;
      CHECK(split.shard().ranks() == std::vector<int>{t + 2 * first, t + 2 * (first + 1)});
      CHECK(split.replicate().ranks() == std::vector<int>{t + 2 * (d % 2), t + 2 * (d % 2 + 2)});
    }
    // Without replicas, FSDP's group is data x context and each rank is its own replica.
    parallel::ProcessMesh plain({.data = n});
    CHECK(plain.shard().ranks() == plain.data_and_context().ranks());
    CHECK(plain.replicate().ranks() == std::vector<int>{dist::rank()});
    CHECK_THROWS_WITH_AS(parallel::ProcessMesh({.data = n, .replicate = 3}),
                         doctest::Contains("replicate=3 must divide"), Error);
  }

  TEST_CASE("parallel::data_parallel: HSDP from the mesh equals DDP, one replica passes through") {
    const int n = dist::world_size();
    auto reference = make_model(100), model = make_model(100);
    const parallel::ProcessMesh mesh({.data = n, .replicate = n % 2 == 0 ? n / 2 : 1});
    auto ddp = parallel::data_parallel(*reference, parallel::ProcessMesh({.data = n}));
    auto sharded = parallel::data_parallel(*model, mesh, {.shard = true});
    // One replica: the model itself behind the face, whose group is this rank.
    CHECK((n == 1) == (dynamic_cast<DistributedDataParallel*>(ddp.get()) == nullptr));
    CHECK(ddp->group().size() == n);
    CHECK(&ddp->module() == reference.get());
    optim::AdamW reference_opt(ddp->trained_parameters(), adamw_options());
    optim::AdamW opt(sharded->trained_parameters(), adamw_options());
    for (int step = 0; step < 5; ++step) {
      auto [x, y] = local_batch(step);
      reference_opt.zero_grad();
      opt.zero_grad();
      {  // an accumulated micro-batch first: no_sync on every wrapper, the pass-through's too
        auto quiet = ddp->no_sync();
        auto also = sharded->no_sync();
        mse_loss(ddp->forward(x), y).backward();
        mse_loss(sharded->forward(x), y).backward();
      }
      const Tensor loss = mse_loss(ddp->forward(x), y);
      loss.backward();
      mse_loss(sharded->forward(x), y).backward();
      reference_opt.step();
      opt.step();
      // The loss every rank reports: the replicas' mean, the global batch's.
      NoGradGuard no_grad;
      Tensor mine = loss.detach().reshape({1}).clone();
      dist::all_reduce(mine, dist::ReduceOp::Avg);
      CHECK(parallel::replica_mean(loss, parallel::ProcessMesh({.data = n})) ==
            doctest::Approx(mine.item<double>()).epsilon(1e-15));
    }
    const nn::NamedTensors want = ddp->full_state_dict(), got = sharded->full_state_dict();
    REQUIRE(want.size() == got.size());
    for (size_t i = 0; i < want.size(); ++i) {
      CAPTURE(want[i].first);
      CHECK(want[i].first == got[i].first);
      CHECK(weave::abs(want[i].second - got[i].second).max().item<double>() <= 1e-10);
    }
    // Groups come from the mesh; replicas need sharding. Every rank raises alike.
    CHECK_THROWS_WITH_AS(
        parallel::data_parallel(*model, mesh, {.shard = true, .fsdp = {.group = dist::world()}}),
        doctest::Contains("the groups come from the mesh"), Error);
    if (n % 2 == 0 && n > 2)
      CHECK_THROWS_WITH_AS(parallel::data_parallel(*model, mesh),
                           doctest::Contains("needs sharding"), Error);
  }

  TEST_CASE("HSDP with a replicate group that overlaps the shard group raises on every rank") {
    if (dist::world_size() < 2) return;
    auto model = make_model(1);
    CHECK_THROWS_WITH_AS(FullyShardedDataParallel(*model, {.replicate_group = dist::world()}),
                         doctest::Contains("in both the shard group"), Error);
  }
}

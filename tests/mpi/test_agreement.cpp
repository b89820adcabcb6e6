// What must be equal across ranks is agreed, not assumed: a deferred model's seed over the shard,
// replicate, tensor-parallel and pipeline groups; HSDP's groups as a replicate x shard grid; the
// wrapper's options across replicas. Each mismatch raises on every rank (none waits for a peer
// that already left), naming what differs.
#include <doctest/doctest.h>

#include <memory>

#include "fsdp_helpers.h"
#include "weave/weave.h"

using namespace weave;
using parallel::FullyShardedDataParallel;

namespace {

models::LlamaOptions tiny_llama() {
  return {.vocab = 32, .dim = 16, .layers = 2, .block = {.heads = 2, .kv_heads = 2, .hidden = 24}};
}

std::shared_ptr<models::Llama> deferred_llama(uint64_t seed, const models::ModelSplit& split = {}) {
  nn::DeferredInit deferred(seed);
  return std::make_shared<models::Llama>(tiny_llama(), split);
}

// Shard groups {0, 1}, {2, 3}; replicate groups as given.
struct Hybrid {
  dist::Group shard, replicate;
};
Hybrid hybrid(const std::vector<std::vector<int>>& replicas) {
  return {dist::split_group(dist::world(), {{0, 1}, {2, 3}}),
          dist::split_group(dist::world(), replicas)};
}

}  // namespace

TEST_SUITE("agreement") {
  TEST_CASE("FSDP over ranks built with different DeferredInit seeds raises on every rank") {
    if (dist::world_size() < 2) return;
    auto model = deferred_llama(dist::rank() == 1 ? 8 : 7);
    CHECK_THROWS_WITH_AS(FullyShardedDataParallel{*model},
                         doctest::Contains("(deferred, seed 7)' on rank 0 but"), Error);
    auto same = deferred_llama(7);  // the same seed everywhere trains
    FullyShardedDataParallel fsdp(*same);
    CHECK(fsdp.parameters().size() > 0);
  }

  TEST_CASE("HSDP replicas built with different seeds raise on every rank") {
    if (dist::world_size() != 4) return;
    const Hybrid groups = hybrid({{0, 2}, {1, 3}});
    // Each shard group agrees within itself: only the replicas tell the seeds apart.
    auto model = deferred_llama(dist::rank() < 2 ? 7 : 9);
    CHECK_THROWS_WITH_AS(FullyShardedDataParallel(
                             *model, {.group = groups.shard, .replicate_group = groups.replicate}),
                         doctest::Contains("seed"), Error);
  }

  TEST_CASE("HSDP options or units that differ between shard groups raise on every rank") {
    if (dist::world_size() != 4) return;
    const Hybrid groups = hybrid({{0, 2}, {1, 3}});
    auto model = deferred_llama(7);
    CHECK_THROWS_WITH_AS(FullyShardedDataParallel(*model, {.group = groups.shard,
                                                           .replicate_group = groups.replicate,
                                                           .check_finite = dist::rank() >= 2}),
                         doctest::Contains("check_finite"), Error);
    // Units alike within each shard group, different between them.
    const std::vector<std::string> units = dist::rank() < 2
                                               ? std::vector<std::string>{"blocks.0", "blocks.1"}
                                               : std::vector<std::string>{"blocks.1", "blocks.0"};
    auto again = deferred_llama(7);
    CHECK_THROWS_WITH_AS(
        FullyShardedDataParallel(
            *again, {.units = units, .group = groups.shard, .replicate_group = groups.replicate}),
        doctest::Contains("ranks disagree on the options and units"), Error);
  }

  TEST_CASE("HSDP groups that are no replicate x shard grid raise on every rank") {
    if (dist::world_size() != 4) return;
    {  // crossed: replicas {0, 3} would average shard 0 with shard 1
      const Hybrid groups = hybrid({{0, 3}, {1, 2}});
      auto model = deferred_llama(7);
      CHECK_THROWS_WITH_AS(FullyShardedDataParallel(*model, {.group = groups.shard,
                                                             .replicate_group = groups.replicate}),
                           doctest::Contains("at the same place in every shard group"), Error);
    }
    {  // uneven: rank 3 in no replicate group, rank 1 alone in its own
      const Hybrid groups = hybrid({{0, 2}, {1}});
      auto model = deferred_llama(7);
      CHECK_THROWS_AS(FullyShardedDataParallel(
                          *model, {.group = groups.shard, .replicate_group = groups.replicate}),
                      Error);
    }
    {  // the grid: constructs, and mesh.str() names both groups
      const parallel::ProcessMesh mesh({.data = 4, .replicate = 2});
      auto model = deferred_llama(7);
      FullyShardedDataParallel hsdp(*model,
                                    {.group = mesh.shard(), .replicate_group = mesh.replicate()});
      CHECK(hsdp.parameters().size() > 0);
      CHECK(mesh.str().find("replicate=2") != std::string::npos);
      CHECK(mesh.str().find("shard " + mesh.shard().str() + " replicate " +
                            mesh.replicate().str()) != std::string::npos);
    }
  }

  TEST_CASE("tensor-parallel pieces drawn with different seeds raise on every rank") {
    const int n = dist::world_size();
    if (n != 2 && n != 4) return;
    const parallel::ProcessMesh mesh({.data = n / 2, .tensor = 2});
    const models::ModelSplit split = models::ModelSplit::from_mesh(mesh);
    const uint64_t seed = mesh.tensor_rank() == 1 ? 8 : 7;
    auto model = deferred_llama(seed, split);
    CHECK_THROWS_WITH_AS(parallel::materialize(*model),
                         doctest::Contains("different nn::DeferredInit seeds"), Error);
    auto under_ddp = deferred_llama(seed, split);
    CHECK_THROWS_WITH_AS(parallel::DistributedDataParallel(*under_ddp, {.group = mesh.data()}),
                         doctest::Contains("different nn::DeferredInit seeds"), Error);
    auto under_fsdp = deferred_llama(seed, split);
    CHECK_THROWS_WITH_AS(FullyShardedDataParallel(*under_fsdp, {.group = mesh.data()}),
                         doctest::Contains("different nn::DeferredInit seeds"), Error);
    auto agreed = deferred_llama(7, split);
    parallel::materialize(*agreed);
    CHECK_FALSE(nn::has_deferred(*agreed));
  }

  TEST_CASE("pipeline stages drawn with different seeds raise on every rank") {
    const int n = dist::world_size();
    if (n < 2) return;
    std::vector<std::vector<int>> singletons;
    for (int r = 0; r < n; ++r) singletons.push_back({r});
    const dist::Group alone = dist::split_group(dist::world(), singletons);
    const models::LlamaOptions options{
        .vocab = 32, .dim = 16, .layers = 4, .block = {.heads = 2, .hidden = 24}};
    auto stage_of = [&](uint64_t seed) {
      nn::DeferredInit deferred(seed);
      return std::make_shared<models::Llama>(
          options, models::ModelSplit{.tensor = alone, .stage = dist::rank(), .stages = n});
    };
    auto stage = stage_of(dist::rank() == n - 1 ? 5 : 4);
    nn::materialize(*stage);
    CHECK_THROWS_WITH_AS(parallel::Pipeline(*stage, {.microbatches = 1}),
                         doctest::Contains("different nn::DeferredInit seeds"), Error);
    auto agreed = stage_of(4);
    nn::materialize(*agreed);
    parallel::Pipeline pipe(*agreed, {.microbatches = 1});
    CHECK(pipe.stages() == n);
  }

  TEST_CASE("a replica overwritten from another seed, then loaded, agrees") {
    // Loaded values are the file's: the seeds they were drawn with no longer count.
    if (dist::world_size() < 2) return;
    auto reference = deferred_llama(7);
    nn::materialize(*reference);
    auto model = deferred_llama(dist::rank() == 1 ? 8 : 7);
    model->load_state_dict(reference->state_dict());
    CHECK(parallel::detail::init_seeds(model->parameters()).empty());
    FullyShardedDataParallel fsdp(*model);
    CHECK(fsdp.parameters().size() > 0);
  }
}

// Deferred initialization across ranks: every layout of a model built under nn::DeferredInit
// holds, bit for bit, what one process materializing the whole model holds (float32 and
// float64): FSDP at any world size (each rank draws only its shards), tensor parallelism,
// FSDP x TP, pipeline stages, experts spread over ranks, and DDP.
#include <doctest/doctest.h>

#include <cstring>
#include <map>
#include <optional>

#include "weave/weave.h"

using namespace weave;

namespace {

constexpr uint64_t kSeed = 2024;

models::LlamaOptions small_llama(int64_t kv_heads = 2) {
  return {.vocab = 64,
          .dim = 32,
          .layers = 4,
          .block = {.heads = 4, .kv_heads = kv_heads, .hidden = 48}};
}

bool bit_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(),
                     size_t(a.numel()) * a.itemsize()) == 0;
}

// One process's model: the whole of it drawn here.
std::map<std::string, Tensor> reference(DType dtype, int64_t kv_heads = 2) {
  std::shared_ptr<models::Llama> model;
  {
    nn::DeferredInit deferred(kSeed);
    model = std::make_shared<models::Llama>(small_llama(kv_heads));
  }
  model->to(dtype);
  nn::materialize(*model);
  std::map<std::string, Tensor> out;
  for (const auto& [name, p] : model->named_parameters()) out[name] = p.detach();
  return out;
}

void check_equal_to(const std::map<std::string, Tensor>& want, const nn::NamedTensors& got) {
  int compared = 0;
  for (const auto& [name, t] : got) {
    if (!want.count(name)) continue;
    const std::string& key = name;  // a lambda cannot capture a binding
    CAPTURE(key);
    CHECK(bit_equal(t, want.at(key)));
    ++compared;
  }
  CHECK(compared > 0);
}

}  // namespace

TEST_SUITE("deferred") {
  TEST_CASE("FSDP over a deferred model draws only its shards, equal to one process bit for bit") {
    for (DType dtype : {kFloat32, kFloat64}) {
      CAPTURE(dtype);
      const std::map<std::string, Tensor> want = reference(dtype);
      size_t whole_bytes = 0;
      for (const auto& [name, p] : want) whole_bytes += size_t(p.numel()) * p.itemsize();
      reset_peak_memory();
      const size_t before = memory_stats().in_use;
      std::shared_ptr<models::Llama> model;
      {
        nn::DeferredInit deferred(kSeed);
        model = std::make_shared<models::Llama>(small_llama());
      }
      model->to(dtype);
      parallel::FullyShardedDataParallel fsdp(*model);
      // Construction held the shards (padded to the world size per unit), a drawn chunk, and
      // the rotary tables: never the whole model on more than one rank.
      const size_t peak = memory_stats().peak - before;
      CHECK(peak < whole_bytes / size_t(dist::world_size()) + 96 * 1024);
      CHECK(nn::has_deferred(*model) == false);
      check_equal_to(want, fsdp.full_state_dict());
      // It trains: a step changes the gathered parameters the same way on every rank.
      optim::AdamW adamw(fsdp.parameters(), {.lr = 1e-3});
      const Tensor ids = from_vector(std::vector<int64_t>{1, 5, 9, 2, 7, 3}, {1, 6});
      sum(fsdp(ids).to(kFloat64)).backward();
      adamw.step();
      const nn::NamedTensors after = fsdp.full_state_dict();
      CHECK_FALSE(bit_equal(after[0].second, want.at(after[0].first)));
    }
  }

  TEST_CASE("DDP materializes a deferred model: every rank holds one process's values") {
    const std::map<std::string, Tensor> want = reference(kFloat32);
    std::shared_ptr<models::Llama> model;
    {
      nn::DeferredInit deferred(kSeed);
      model = std::make_shared<models::Llama>(small_llama());
    }
    parallel::DistributedDataParallel ddp(*model);
    check_equal_to(want, model->named_parameters());
  }

  TEST_CASE("tensor-parallel slices of a deferred model gather to one process's values") {
    const int n = dist::world_size();
    if (4 % n != 0) return;  // the 4 query heads split over 1, 2 or 4 ranks
    for (DType dtype : {kFloat32, kFloat64}) {
      CAPTURE(dtype);
      const std::map<std::string, Tensor> want = reference(dtype, n);
      std::shared_ptr<models::Llama> model;
      {
        nn::DeferredInit deferred(kSeed);
        model = std::make_shared<models::Llama>(small_llama(n),
                                                models::ModelSplit{.tensor = dist::world()});
      }
      model->to(dtype);
      nn::materialize(*model);
      check_equal_to(want, parallel::gather_state_dict(*model));
    }
  }

  TEST_CASE("experts spread over the ranks hold one process's values (EP)") {
    const int n = dist::world_size();
    if (4 % n != 0) return;  // 4 experts over 1, 2 or 4 ranks
    std::vector<std::vector<int>> singletons;
    for (int r = 0; r < n; ++r) singletons.push_back({r});
    const dist::Group self = dist::split_group(dist::world(), singletons);
    const nn::MoEOptions moe{.hidden = 32, .ffn = 16, .router = {.experts = 4, .top_k = 2}};
    auto build = [&](std::optional<dist::Group> experts) {
      nn::DeferredInit deferred(kSeed);
      models::LlamaOptions options = small_llama();
      options.block.moe = moe;
      return std::make_shared<models::Llama>(
          options, models::ModelSplit{.tensor = self, .expert_group = experts});
    };
    auto whole = build(std::nullopt), spread = build(dist::world());
    nn::materialize(*whole);
    nn::materialize(*spread);
    std::map<std::string, Tensor> want;
    for (const auto& [name, p] : whole->named_parameters()) want[name] = p.detach();
    check_equal_to(want, spread->named_parameters());  // experts by their global names
    if (n > 1) CHECK(spread->named_parameters().size() < want.size());
  }

  TEST_CASE("FSDP x TP and pipeline stages of a deferred model hold one process's values") {
    if (dist::world_size() != 4) return;
    const parallel::ProcessMesh mesh({.data = 2, .tensor = 2});
    // FSDP over the data axis of a tensor-parallel model: its gathered slices are the slices a
    // materialized tensor-parallel model holds (which gather to one process's, above).
    auto build_tp = [&] {
      nn::DeferredInit deferred(kSeed);
      return std::make_shared<models::Llama>(small_llama(2),
                                             models::ModelSplit{.tensor = mesh.tensor()});
    };
    auto plain = build_tp();
    nn::materialize(*plain);
    auto sharded = build_tp();
    parallel::FullyShardedDataParallel fsdp(*sharded, {.group = mesh.data()});
    std::map<std::string, Tensor> slices;
    for (const auto& [name, p] : plain->named_parameters()) slices[name] = p.detach();
    check_equal_to(slices, fsdp.full_state_dict());
    // Pipeline stage s of 4 holds block s under its whole-model name.
    const std::map<std::string, Tensor> want = reference(kFloat32);
    const dist::Group alone = dist::split_group(dist::world(), {{0}, {1}, {2}, {3}});
    std::shared_ptr<models::Llama> stage;
    {
      nn::DeferredInit deferred(kSeed);
      stage = std::make_shared<models::Llama>(
          small_llama(), models::ModelSplit{.tensor = alone, .stage = dist::rank(), .stages = 4});
    }
    nn::materialize(*stage);
    check_equal_to(want, stage->named_parameters());
    CHECK(stage->named_parameters().size() < want.size());
  }
}

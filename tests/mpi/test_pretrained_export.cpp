// Hugging Face exports and loads of models split over ranks: parallel::save_pretrained writes,
// from FSDP shards, tensor-parallel slices, both, and pipeline stages, the very files one
// process writes for the whole model, holding one whole parameter at a time; and
// load_pretrained into an FSDP model built for loading draws nothing and peaks at 1/N of one
// process's load plus one tensor; gather_whole_state_dict puts any layout's model together.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "helpers.h"
#include "pretrained_helpers.h"
#include "weave/weave.h"

using namespace weave;
using weave::test::pretrained::block_units;
using weave::test::pretrained::split_model;
namespace fs = std::filesystem;

namespace {

const std::string kData = std::string(WEAVE_TEST_DATA_DIR) + "/hf/";

// Every file of `expected` (the one-process export) is in `actual`, byte for byte, and nothing
// else is.
void check_same_files(const std::string& expected, const std::string& actual) {
  std::set<std::string> names, theirs;
  for (const auto& entry : fs::directory_iterator(expected))
    names.insert(entry.path().filename().string());
  for (const auto& entry : fs::directory_iterator(actual))
    theirs.insert(entry.path().filename().string());
  CHECK(names == theirs);
  for (const std::string& name : names) {
    CAPTURE(name);
    CHECK(data::read_file(expected + "/" + name) == data::read_file(actual + "/" + name));
  }
}

// The tensors of a checkpoint's safetensors files, by name (GPT-2's "transformer." dropped).
std::map<std::string, Tensor> checkpoint_tensors(const std::string& dir) {
  std::map<std::string, Tensor> out;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().extension() == ".safetensors" && entry.path().stem() != "logits")
      for (auto& [name, t] : data::load_safetensors(entry.path().string()).tensors)
        out[name.starts_with("transformer.") ? name.substr(12) : name] = t;
  return out;
}

// A new Llama of `config` written by rank 0 into dir (collective).
void write_llama(const data::hf::ModelConfig& config, const std::string& dir) {
  if (dist::rank() == 0) {
    Generator generator(5);
    data::hf::save_pretrained(*models::make_model(config, {}, &generator), config, dir);
  }
  dist::barrier();
}

data::hf::ModelConfig small_llama() {
  data::hf::ModelConfig config;
  config.architecture = "llama";
  config.vocab = 1024, config.dim = 128, config.layers = 6, config.heads = 4, config.kv_heads = 2;
  config.hidden = models::llama_hidden(config.dim), config.max_positions = 256;
  return config;
}

// dir's checkpoint in FSDP over every rank, its units the blocks, built for the load (nothing
// drawn).
struct ShardedLoad {
  std::shared_ptr<nn::CausalLM> model;
  std::unique_ptr<parallel::FullyShardedDataParallel> fsdp;
};
ShardedLoad load_sharded(const data::hf::ModelConfig& config, const std::string& dir) {
  ShardedLoad loaded;
  {
    auto deferred = nn::DeferredInit::for_loading();
    loaded.model = models::make_model(config);
  }
  loaded.fsdp = std::make_unique<parallel::FullyShardedDataParallel>(
      *loaded.model, parallel::FSDPOptions{.units = block_units(config)});
  parallel::load_pretrained(loaded.fsdp->sharded_module(), config, dir);
  return loaded;
}

int64_t largest_parameter_bytes(const nn::Module& model) {
  int64_t largest = 0;
  for (const auto& [name, p] : model.named_parameters())
    largest = std::max(largest, p.numel() * int64_t(p.itemsize()));
  return largest;
}

}  // namespace

TEST_SUITE("pretrained") {
  TEST_CASE("save_pretrained of shards, slices and stages writes one process's files") {
    const int world = dist::world_size();
    for (const std::string arch : {"gpt2", "llama", "qwen3", "mistral", "gemma2", "gemma3",
                                   "mixtral", "qwen3_moe", "qwen2_moe"}) {
      for (const uint64_t shard_bytes : {uint64_t(5) << 30, uint64_t(40000)}) {
        CAPTURE(arch);
        CAPTURE(shard_bytes);
        const std::string dir = kData + arch;
        const auto config = data::hf::read_config(dir);
        const std::string out = test::shared_dir("export_" + arch);
        if (dist::rank() == 0) {  // the reference: one process's export, the input's tensors
          data::hf::save_pretrained(*models::from_pretrained(dir), config, out + "/whole",
                                    {.max_shard_bytes = shard_bytes});
          const auto expected = checkpoint_tensors(dir),
                     actual = checkpoint_tensors(out + "/whole");
          REQUIRE(expected.size() == actual.size());
          for (const auto& entry : expected) {
            const std::string& name = entry.first;  // CAPTURE needs a variable, not a binding
            CAPTURE(name);
            REQUIRE(actual.count(name) == 1);
            CHECK(equal(entry.second, actual.at(name)));
          }
        }
        const auto check = [&](nn::Module& parts, const std::string& layout,
                               const dist::Group& group) {
          CAPTURE(layout);
          parallel::save_pretrained(parts, config, out + "/" + layout,
                                    {.max_shard_bytes = shard_bytes}, group);
          dist::barrier();
          if (dist::rank() == 0) check_same_files(out + "/whole", out + "/" + layout);
        };
        {  // FSDP over every rank
          const ShardedLoad loaded = load_sharded(config, dir);
          check(loaded.fsdp->sharded_module(), "fsdp", dist::world());
        }
        if (world == 2 || world == 4) {  // tensor parallel over every rank; 2 pipeline stages
          auto tp = split_model(config, dist::world(), {});
          parallel::load_pretrained(*tp, config, dir);
          check(*tp, "tp", dist::world());
          parallel::ProcessMesh mesh({.data = world / 2, .pipeline = 2});
          auto stage =
              split_model(config, mesh.tensor(), {.stage = mesh.pipeline_rank(), .stages = 2});
          parallel::load_pretrained(*stage, config, dir);
          check(*stage, "pipeline", dist::world());
        }
        if (world == 4) {  // FSDP 2 x TP 2
          parallel::ProcessMesh mesh({.data = 2, .tensor = 2});
          auto slices = split_model(config, mesh.tensor(), {});
          parallel::FullyShardedDataParallel fsdp(
              *slices, {.units = block_units(config), .group = mesh.data()});
          parallel::load_pretrained(fsdp.sharded_module(), config, dir);
          check(fsdp.sharded_module(), "fsdp_tp", dist::world());
        }
      }
    }
  }

  // Mixtral's and the Qwen MoEs' experts spread over the ranks by their global index (each rank
  // reads only its experts' tensors), alone and (4 ranks) with 2 tensor-parallel ranks: PyTorch's
  // logits, one process's greedy tokens, and exports that equal one process's files.
  TEST_CASE("expert-parallel Mixtral and Qwen 3 MoE read their experts and export one process's") {
    const int world = dist::world_size();
    for (const std::string arch : {"mixtral", "qwen3_moe", "qwen2_moe"}) {
      CAPTURE(arch);
      const std::string dir = kData + arch;
      const auto config = data::hf::read_config(dir);
      const std::string out = test::shared_dir("export_ep_" + arch);
      if (dist::rank() == 0)
        data::hf::save_pretrained(*models::from_pretrained(dir), config, out + "/whole");
      Tensor tokens, expected;
      for (const auto& [name, t] : data::load_safetensors(dir + "/logits.safetensors").tensors)
        (name == "tokens" ? tokens : expected) = t;
      for (const int tensor : {1, 2}) {
        if (tensor == 2 && world != 4) continue;
        CAPTURE(tensor);
        parallel::ProcessMesh mesh(
            {.data = world / tensor, .tensor = tensor, .expert = world / tensor});
        auto model = models::make_model(
            config, models::ModelSplit::from_mesh(mesh, {.gather_logits = true}));
        const auto stats = parallel::load_pretrained(*model, config, dir);
        if (world > 1) {  // the dense rest (or its slices) and this rank's share of the experts
          int64_t total = 0, experts = 0;
          for (const auto& [name, t] : checkpoint_tensors(dir)) {
            const int64_t bytes = t.numel() * int64_t(t.itemsize());
            total += bytes;
            experts += name.find(".experts.") != std::string::npos ? bytes : 0;
          }
          CHECK(stats.bytes_read <= total - experts + experts / (world / tensor));
        }
        NoGradGuard no_grad;
        const Tensor logits = (*model)(tokens);
        CHECK(max(abs(logits.to(kFloat64) - expected)).item<double>() <
              2e-6 * max(abs(expected)).item<double>());
        // Greedy decoding with the experts spread: one process's tokens.
        const Tensor prompt = tokens.narrow(1, 0, 4);
        const nn::GenerationOptions greedy{.max_new_tokens = 16};
        CHECK(equal(nn::generate(*model, prompt, greedy),
                    nn::generate(*models::from_pretrained(dir), prompt, greedy)));
        const std::string layout = "ep_tp" + std::to_string(tensor);
        parallel::save_pretrained(*model, config, out + "/" + layout, {}, dist::world());
        dist::barrier();
        if (dist::rank() == 0) check_same_files(out + "/whole", out + "/" + layout);
      }
    }
  }

  TEST_CASE("gather_whole_state_dict of shards, slices and stages: one process's state at rank 0") {
    const int world = dist::world_size();
    for (const std::string arch : {"gpt2", "llama", "qwen3"}) {
      CAPTURE(arch);
      const std::string dir = kData + arch;
      const auto config = data::hf::read_config(dir);
      nn::NamedTensors want;
      if (dist::rank() == 0) want = models::from_pretrained(dir)->state_dict();
      const auto check = [&](nn::Module& parts, const std::string& layout) {
        CAPTURE(layout);
        const nn::NamedTensors got = parallel::gather_whole_state_dict(parts);
        if (dist::rank() != 0) {
          CHECK(got.empty());
          return;
        }
        std::map<std::string, Tensor> by_name(got.begin(), got.end());
        REQUIRE(by_name.size() == want.size());
        for (const auto& [name, value] : want) {
          const std::string& key = name;  // CAPTURE needs a variable, not a binding
          CAPTURE(key);
          REQUIRE(by_name.count(name) == 1);
          CHECK(equal(by_name.at(name), value));
        }
      };
      {  // FSDP over every rank
        const ShardedLoad loaded = load_sharded(config, dir);
        check(loaded.fsdp->sharded_module(), "fsdp");
      }
      if (world == 2 || world == 4) {  // every rank's slices (GPT-2's vocabulary padded); stages
        auto tp = split_model(config, dist::world(), {});
        parallel::load_pretrained(*tp, config, dir);
        check(*tp, "tp");
        parallel::ProcessMesh mesh({.data = world / 2, .pipeline = 2});
        auto stage =
            split_model(config, mesh.tensor(), {.stage = mesh.pipeline_rank(), .stages = 2});
        parallel::load_pretrained(*stage, config, dir);
        check(*stage, "pipeline");
      }
    }
  }

  TEST_CASE("a failed export, or parts no rank of the group holds, raise on every rank") {
    const std::string dir = kData + "llama";
    const auto config = data::hf::read_config(dir);
    const std::string out = test::shared_dir("export_fails");
    const ShardedLoad loaded = load_sharded(config, dir);
    parallel::FullyShardedDataParallel& fsdp = *loaded.fsdp;
    if (dist::rank() == 0) {  // rank 0 cannot write: its directory is a file
      fs::create_directories(out);
      std::ofstream(out + "/file") << "x";
    }
    dist::barrier();
    // Rank 0 raises its own error, the others that rank 0 failed.
    const char* expected = dist::rank() == 0 ? "exists and is not a directory" : "save_pretrained";
    CHECK_THROWS_WITH_AS(parallel::save_pretrained(fsdp.sharded_module(), config, out + "/file"),
                         doctest::Contains(expected), Error);
    if (dist::world_size() > 1) {  // the group leaves out the ranks that hold the other shards
      std::vector<std::vector<int>> singles;
      for (int r = 0; r < dist::world_size(); ++r) singles.push_back({r});
      const dist::Group alone = dist::split_group(dist::world(), singles);
      CHECK_THROWS_WITH_AS(
          parallel::save_pretrained(fsdp.sharded_module(), config, out + "/alone", {}, alone),
          doctest::Contains("no rank of group"), Error);
    }
    dist::barrier();
    if (dist::rank() == 0) CHECK(!fs::exists(out + "/alone/model.safetensors"));
  }

  TEST_CASE("save_pretrained under FSDP holds one whole parameter at a time") {
    const auto config = small_llama();
    const std::string dir = test::shared_dir("export_memory");
    write_llama(config, dir + "/in");
    const ShardedLoad loaded = load_sharded(config, dir + "/in");
    parallel::FullyShardedDataParallel& fsdp = *loaded.fsdp;
    int64_t total = 0;
    for (const Tensor& shard : fsdp.parameters())
      total += shard.numel() * int64_t(shard.itemsize());
    total *= dist::world_size();
    const int64_t largest = largest_parameter_bytes(*loaded.model);
    REQUIRE(total > 4 * largest);  // else the bound below could not tell a whole gather apart
    const int64_t before = int64_t(memory_stats().in_use);
    reset_peak_memory();
    parallel::save_pretrained(fsdp.sharded_module(), config, dir + "/out");
    const int64_t held = int64_t(memory_stats().peak) - before;
    CAPTURE(held);
    CAPTURE(largest);
    CHECK(held <= largest);
    dist::barrier();
    if (dist::rank() == 0) check_same_files(dir + "/in", dir + "/out");
  }

  TEST_CASE("load_pretrained into FSDP draws nothing and peaks at 1/N of one process + a tensor") {
    const auto config = small_llama();
    const std::string dir = test::shared_dir("load_memory");
    write_llama(config, dir);
    int64_t before = int64_t(memory_stats().in_use);
    reset_peak_memory();
    models::from_pretrained(dir).reset();
    const int64_t one_process = int64_t(memory_stats().peak) - before;
    before = int64_t(memory_stats().in_use);
    reset_peak_memory();
    const int64_t drawn_before = nn::drawn_elements();
    {
      std::shared_ptr<nn::CausalLM> model;
      {
        auto deferred = nn::DeferredInit::for_loading();
        model = models::make_model(config);
      }
      parallel::FullyShardedDataParallel fsdp(*model, {.units = block_units(config)});
      parallel::load_pretrained(fsdp.sharded_module(), config, dir);
    }
    const int64_t sharded = int64_t(memory_stats().peak) - before;
    CAPTURE(one_process);
    CAPTURE(sharded);
    CHECK(nn::drawn_elements() == drawn_before);  // FSDP allocated the shards, drew none
    // 1/N of one process's load plus one whole tensor (the one being read), at every N.
    const int world = dist::world_size();
    const auto whole = models::from_pretrained(dir);
    const double bound = double(one_process) / world + double(largest_parameter_bytes(*whole));
    CHECK(double(sharded) <= bound);
  }

  TEST_CASE("tied Llama and Qwen 2 heads split over tensor and pipeline ranks equal one process") {
    for (const std::string arch : {"llama", "qwen2", "qwen3"}) {
      CAPTURE(arch);
      const std::string dir = test::shared_dir("tied_" + arch);
      if (dist::rank() == 0) {  // the reference with tie_word_embeddings (lm_head passed over)
        fs::create_directories(dir);
        for (const auto& entry : fs::directory_iterator(kData + arch))
          fs::copy_file(entry.path(), dir + "/" + entry.path().filename().string());
        auto config = nlohmann::json::parse(std::ifstream(dir + "/config.json"));
        config["tie_word_embeddings"] = true;
        std::ofstream(dir + "/config.json") << config.dump();
      }
      dist::barrier();
      Tensor tokens;
      for (const auto& [name, t] : data::load_safetensors(dir + "/logits.safetensors").tensors)
        if (name == "tokens") tokens = t;
      auto whole = models::from_pretrained(dir);
      NoGradGuard no_grad;
      const Tensor expected = (*whole)(tokens);
      auto tp = models::from_pretrained(dir, {.tensor = dist::world(), .gather_logits = true});
      CHECK(max(abs((*tp)(tokens)-expected)).item<double>() < 1e-6);
      const Tensor prompt = tokens.narrow(1, 0, 4);
      const nn::GenerationOptions greedy{.max_new_tokens = 24};
      CHECK(equal(nn::generate(*tp, prompt, greedy), nn::generate(*whole, prompt, greedy)));
      if (dist::world_size() % 2 == 0) {  // 2 stages, each over world / 2 tensor ranks
        parallel::ProcessMesh mesh({.tensor = dist::world_size() / 2, .pipeline = 2});
        auto stage = models::from_pretrained(dir, {.tensor = mesh.tensor(),
                                                   .gather_logits = true,
                                                   .stage = mesh.pipeline_rank(),
                                                   .stages = 2});
        parallel::Pipeline pipe(*stage, {.microbatches = 2, .group = mesh.pipeline()});
        const Tensor logits = pipe.predict(tokens);
        if (pipe.is_last()) CHECK(max(abs(logits - expected)).item<double>() < 1e-6);
      }
      // The export holds the one tied tensor, as Hugging Face's tied checkpoints do.
      const std::string out = test::shared_dir("tied_export_" + arch);
      parallel::save_pretrained(*tp, data::hf::read_config(dir), out);
      if (dist::rank() == 0) {
        const auto tensors = checkpoint_tensors(out);
        CHECK(tensors.count("model.embed_tokens.weight") == 1);
        CHECK(tensors.count("lm_head.weight") == 0);
        auto reloaded = models::from_pretrained(out);
        CHECK(equal((*reloaded)(tokens), expected));
      }
      dist::barrier();
    }
  }
}

// Hugging Face checkpoints loaded over ranks: a tensor-parallel Llama whose ranks read only
// their slices, a fully sharded one whose ranks read only their shards, and both together,
// against the logits
// PyTorch computed (tests/data/hf, written by bench/pretrained/hf_reference.py); tensor-parallel
// greedy decoding against one process's.
#include <doctest/doctest.h>

#include <filesystem>
#include <functional>

#include "pretrained_helpers.h"
#include "weave/weave.h"

using namespace weave;
using weave::test::pretrained::block_units;
using weave::test::pretrained::split_model;

namespace {

const std::string kData = std::string(WEAVE_TEST_DATA_DIR) + "/hf/";

double max_abs_diff(const Tensor& a, const Tensor& b) {
  return max(abs(a.to(kFloat64) - b.to(kFloat64))).item<double>();
}

std::pair<Tensor, Tensor> reference_logits(const std::string& dir) {
  Tensor tokens, logits;
  for (const auto& [name, t] : data::load_safetensors(dir + "/logits.safetensors").tensors)
    (name == "tokens" ? tokens : logits) = t;
  return {tokens, logits};
}

// The reference Llama checkpoint in one file at dir, each tensor as `change` returns it.
void single_file_llama(const std::string& dir,
                       const std::function<Tensor(const std::string&, const Tensor&)>& change) {
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  nn::NamedTensors tensors;
  for (const auto& entry : std::filesystem::directory_iterator(kData + "llama"))
    if (entry.path().filename().string().starts_with("model-"))
      for (auto& [name, t] : data::load_safetensors(entry.path().string()).tensors)
        tensors.emplace_back(name, change(name, t));
  data::save_safetensors(dir + "/model.safetensors", tensors);
  std::filesystem::copy_file(kData + "llama/config.json", dir + "/config.json");
}

uint64_t checkpoint_bytes(const std::string& dir) {
  uint64_t bytes = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    if (entry.path().filename().string().starts_with("model-"))
      for (const auto& e : data::read_safetensors_header(entry.path().string()).entries)
        bytes += e.end - e.begin;
  return bytes;
}

}  // namespace

TEST_SUITE("pretrained") {
  TEST_CASE("tensor-parallel GPT-2 and Llama read their slices and give PyTorch's logits") {
    for (const std::string arch : {"gpt2", "llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3",
                                   "mixtral", "qwen3_moe", "qwen2_moe"}) {
      CAPTURE(arch);
      const std::string dir = kData + arch;
      const auto config = data::hf::read_config(dir);
      auto model = split_model(config, dist::world(), {.gather_logits = true});
      const auto stats = parallel::load_pretrained(*model, config, dir);
      const auto [tokens, expected] = reference_logits(dir);
      NoGradGuard no_grad;
      CHECK(max_abs_diff((*model)(tokens), expected) < 1e-5);
      // Norms, GPT-2's position embedding and biases of row-parallel layers, and Llama's kv
      // with fewer key/value heads than ranks, are whole on every rank; the rest is a share.
      // (The experts are whole on every tensor rank: expert parallelism spreads them, below.)
      if (dist::world_size() > 1 && config.experts == 0)
        CHECK(uint64_t(stats.bytes_read) < checkpoint_bytes(dir) * 3 / 4);
    }
  }

  TEST_CASE("tensor-parallel greedy decoding gives one process's tokens") {
    for (const std::string arch : {"gpt2", "llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3",
                                   "mixtral", "qwen3_moe", "qwen2_moe"}) {
      CAPTURE(arch);
      const std::string dir = kData + arch;
      const auto config = data::hf::read_config(dir);
      auto split = split_model(config, dist::world(), {});
      parallel::load_pretrained(*split, config, dir);
      auto whole = models::from_pretrained(dir);
      const Tensor prompt =
          from_vector(std::vector<int64_t>{5, 17, 300, 42, 7, 99, 1, 2, 3, 4}, {2, 5});
      const nn::GenerationOptions greedy{.max_new_tokens = 64};
      CHECK(max_abs_diff(nn::generate(*split, prompt, greedy),
                         nn::generate(*whole, prompt, greedy)) == 0);
    }
  }

  TEST_CASE("fully sharded GPT-2 and Llama read only their shards and give PyTorch's logits") {
    for (const std::string arch : {"gpt2", "llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3",
                                   "mixtral", "qwen3_moe", "qwen2_moe"}) {
      CAPTURE(arch);
      const std::string dir = kData + arch;
      const auto config = data::hf::read_config(dir);
      Generator generator(3);  // the same on every rank, as FSDP checks
      auto model = models::make_model(config, {}, &generator);
      parallel::FullyShardedDataParallel fsdp(
          *model, {.units = block_units(config), .group = dist::world()});
      const auto stats = parallel::load_pretrained(fsdp.sharded_module(), config, dir);
      const auto [tokens, expected] = reference_logits(dir);
      NoGradGuard no_grad;
      CHECK(max_abs_diff(fsdp(tokens), expected) < 1e-5);
      // Each rank reads its share (and a few rows where its shard begins and ends mid-row).
      Tensor bytes = from_vector(std::vector<double>{double(stats.bytes_read)}, {1});
      dist::all_reduce(bytes);
      const double total = double(checkpoint_bytes(dir));
      CHECK(bytes.item<double>() >= total);
      CHECK(bytes.item<double>() < total * 1.1);
      CHECK(double(stats.bytes_read) < total / dist::world_size() * 1.2);
    }
  }

  TEST_CASE("tensor parallel 2 x fully sharded 2: each rank reads its slices' shards") {
    if (dist::world_size() != 4) return;
    parallel::ProcessMesh mesh({.data = 2, .tensor = 2});
    for (const std::string arch : {"gpt2", "llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3",
                                   "mixtral", "qwen3_moe", "qwen2_moe"}) {
      CAPTURE(arch);
      const std::string dir = kData + arch;
      const auto config = data::hf::read_config(dir);
      auto model = split_model(config, mesh.tensor(), {.gather_logits = true});
      parallel::FullyShardedDataParallel fsdp(*model,
                                              {.units = block_units(config), .group = mesh.data()});
      const auto stats = parallel::load_pretrained(fsdp.sharded_module(), config, dir);
      const auto [tokens, expected] = reference_logits(dir);
      NoGradGuard no_grad;
      CHECK(max_abs_diff(fsdp(tokens), expected) < 1e-5);
      CHECK(uint64_t(stats.bytes_read) < checkpoint_bytes(dir) / 2);
    }
  }

  TEST_CASE("a bad tensor that one rank's shard reads raises on every rank") {
    // Llama with block 1's down projection stored as int32, in one file: under FSDP only the
    // ranks whose shard of block 1 reaches its last member read it.
    const std::string dir =
        (std::filesystem::temp_directory_path() / "weave_pretrained_bad").string();
    if (dist::rank() == 0)
      single_file_llama(dir, [](const std::string& name, const Tensor& t) {
        return name == "model.layers.1.mlp.down_proj.weight" ? t.to(kInt32) : t;
      });
    dist::barrier();
    const auto config = data::hf::read_config(dir);
    Generator generator(3);
    auto model = models::make_model(config, {}, &generator);
    parallel::FullyShardedDataParallel fsdp(*model,
                                            {.units = block_units(config), .group = dist::world()});
    CHECK_THROWS_AS(parallel::load_pretrained(fsdp.sharded_module(), config, dir), Error);
    dist::barrier();
    if (dist::rank() == 0) std::filesystem::remove_all(dir);
  }

  TEST_CASE("a rank that loads another checkpoint of the same shapes raises on every rank") {
    if (dist::world_size() < 2) return;
    const auto temp = std::filesystem::temp_directory_path();
    const std::string same = (temp / "weave_pretrained_same").string(),
                      copy = (temp / "weave_pretrained_copy").string(),
                      other = (temp / "weave_pretrained_other").string();
    if (dist::rank() == 0)  // the other checkpoint's final norm doubled
      for (const std::string& dir : {same, copy, other})
        single_file_llama(dir, [&](const std::string& name, const Tensor& t) {
          return dir == other && name == "model.norm.weight" ? t * 2 : t;
        });
    dist::barrier();
    const auto config = data::hf::read_config(same);
    const std::string mine = dist::rank() == 1 ? other : same;
    auto split = split_model(config, dist::world(), {});
    CHECK_THROWS_WITH_AS(parallel::load_pretrained(*split, config, mine),
                         doctest::Contains("disagree on the checkpoint files"), Error);
    Generator generator(3);
    auto model = models::make_model(config, {}, &generator);
    parallel::FullyShardedDataParallel fsdp(*model,
                                            {.units = block_units(config), .group = dist::world()});
    CHECK_THROWS_WITH_AS(parallel::load_pretrained(fsdp.sharded_module(), config, mine),
                         doctest::Contains("disagree on the checkpoint files"), Error);
    // The same checkpoint at two paths (a copy on each host) loads.
    parallel::load_pretrained(*split, config, dist::rank() == 1 ? copy : same);
    dist::barrier();
    if (dist::rank() == 0)
      for (const std::string& dir : {same, copy, other}) std::filesystem::remove_all(dir);
  }

  TEST_CASE("a vocabulary that does not divide among the ranks is padded, with PyTorch's logits") {
    // The reference checkpoints with 511 of their 512 tokens (511 = 7 x 73): their logits are
    // PyTorch's without the last column (GPT-2's tied head and Llama's head read one row per
    // token; the fixed tokens lie below 511).
    constexpr int64_t kVocab = 511;
    for (const std::string arch : {"gpt2", "llama"}) {
      CAPTURE(arch);
      const std::string dir =
          (std::filesystem::temp_directory_path() / ("weave_pretrained_511_" + arch)).string();
      if (dist::rank() == 0) {
        std::filesystem::remove_all(dir);
        auto config = data::hf::read_config(kData + arch);
        auto model = models::from_pretrained(kData + arch);
        config.vocab = kVocab;
        auto smaller = models::make_model(config);
        nn::NamedTensors state = model->state_dict();
        for (auto& [name, t] : state)
          if (name == "tokens.weight" || name == "embedding.weight" || name == "head.weight")
            t = t.narrow(0, 0, kVocab).contiguous();
        smaller->load_state_dict(state);
        data::hf::save_pretrained(*smaller, config, dir);
      }
      dist::barrier();
      const auto config = data::hf::read_config(dir);
      const auto [tokens, all] = reference_logits(kData + arch);
      REQUIRE(max(tokens).item<double>() < kVocab);
      const Tensor expected = all.narrow(-1, 0, kVocab);
      auto gathered = split_model(config, dist::world(), {.gather_logits = true});
      parallel::load_pretrained(*gathered, config, dir);
      {
        NoGradGuard no_grad;
        CHECK(max_abs_diff((*gathered)(tokens), expected) < 1e-5);
      }
      // Each rank's slice: the padding masked, the loss and its gradient as one process's.
      auto sliced = split_model(config, dist::world(), {});
      parallel::load_pretrained(*sliced, config, dir);
      const Tensor logits = (*sliced)(tokens);
      const Tensor targets = tokens.reshape({-1});
      const Tensor loss = parallel::vocab_parallel_cross_entropy(
          logits.reshape({-1, logits.size(-1)}), targets, dist::world());
      loss.backward();
      CHECK(std::abs(loss.item<double>() -
                     cross_entropy(expected.reshape({-1, kVocab}), targets).item<double>()) < 1e-5);
      for (auto& [parameter, p] : sliced->named_parameters()) {
        const std::string name = parameter;  // a copy: CAPTURE's lambda cannot take a binding
        CAPTURE(name);
        CHECK(all_finite(p.grad()));
      }
      // Greedy decoding as one process, and the export equal to the checkpoint.
      auto whole = models::from_pretrained(dir);
      const Tensor prompt = tokens.narrow(1, 0, 4);
      const nn::GenerationOptions greedy{.max_new_tokens = 16};
      CHECK(max_abs_diff(nn::generate(*gathered, prompt, greedy),
                         nn::generate(*whole, prompt, greedy)) == 0);
      auto exported = models::make_model(config);  // the gathered state, padding dropped
      exported->load_state_dict(parallel::gather_state_dict(*gathered));
      const auto mine = exported->named_parameters(), theirs = whole->named_parameters();
      REQUIRE(mine.size() == theirs.size());
      for (size_t i = 0; i < mine.size(); ++i) {
        CAPTURE(mine[i].first);
        CHECK(max_abs_diff(mine[i].second, theirs[i].second) == 0);
      }
      // Sharded checkpoints hold the real rows only: a split model's loads into the whole model,
      // and the whole model's into a split one.
      data::TrainingState from_split{.model = gathered.get(), .default_generator = false};
      parallel::save_sharded_checkpoint(dir + "/split_ckpt", from_split);
      Generator other(11);
      auto fresh = models::make_model(config, {}, &other);
      data::TrainingState into_whole{.model = fresh.get(), .default_generator = false};
      parallel::load_sharded_checkpoint(dir + "/split_ckpt", into_whole);
      const auto loaded = fresh->named_parameters();
      for (size_t i = 0; i < loaded.size(); ++i) {
        CAPTURE(loaded[i].first);
        CHECK(max_abs_diff(loaded[i].second, theirs[i].second) == 0);
      }
      data::TrainingState from_whole{.model = whole.get(), .default_generator = false};
      parallel::save_sharded_checkpoint(dir + "/whole_ckpt", from_whole);
      auto split_again = split_model(config, dist::world(), {.gather_logits = true});
      data::TrainingState into_split{.model = split_again.get(), .default_generator = false};
      parallel::load_sharded_checkpoint(dir + "/whole_ckpt", into_split);
      {
        NoGradGuard no_grad;
        CHECK(max_abs_diff((*split_again)(tokens), expected) < 1e-5);
      }
      dist::barrier();
      if (dist::rank() == 0) std::filesystem::remove_all(dir);
    }
  }

  TEST_CASE("context parallel (and tensor parallel) parts give PyTorch's logits of their parts") {
    if (dist::world_size() % 2 != 0) return;
    parallel::ProcessMesh mesh({.tensor = dist::world_size() / 2, .context = 2});
    for (const std::string arch : {"gpt2", "llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3",
                                   "mixtral", "qwen3_moe", "qwen2_moe"}) {
      CAPTURE(arch);
      const std::string dir = kData + arch;
      const auto config = data::hf::read_config(dir);
      const auto [tokens, expected] = reference_logits(dir);
      const auto part = [&](const Tensor& whole) {
        return parallel::shard_sequence(whole, 1, mesh.context(), parallel::SequenceLayout::ZigZag);
      };
      // Packed documents of 7, 9 and 8 positions (positions restarting in each; the windows of 5
      // reach across the zig-zag chunks of 6): one process's logits are the truth.
      std::vector<int64_t> ids, at;
      for (int64_t i = 0; i < tokens.size(1); ++i) {
        const int64_t doc = i < 7 ? 0 : (i < 16 ? 1 : 2);
        ids.push_back(doc), at.push_back(i - (doc == 0 ? 0 : doc == 1 ? 7 : 16));
      }
      const Tensor documents = from_vector(ids), positions = from_vector(at);
      Tensor packed;
      {
        NoGradGuard no_grad;
        packed = (*models::from_pretrained(dir))(nn::Inputs(tokens, positions, documents));
      }
      // All-to-all takes heads that divide over the tensor and context ranks (Gemma 3's one
      // key/value head does not).
      const int64_t split_heads = mesh.shape().tensor * 2;
      const bool heads_divide = config.kv_heads % split_heads == 0;
      for (const auto mode :
           {parallel::ContextParallelMode::Ring, parallel::ContextParallelMode::AllToAll}) {
        if (mode == parallel::ContextParallelMode::AllToAll && !heads_divide) continue;
        CAPTURE(int(mode));
        auto model = split_model(
            config, mesh.tensor(),
            {.gather_logits = true, .context_group = mesh.context(), .context_mode = mode});
        parallel::load_pretrained(*model, config, dir);
        NoGradGuard no_grad;
        CHECK(max_abs_diff((*model)(part(tokens)), part(expected)) < 1e-5);
        const auto cut = [&](const Tensor& t) {
          return parallel::shard_sequence(t, 0, mesh.context(), parallel::SequenceLayout::ZigZag);
        };
        CHECK(max_abs_diff((*model)(nn::Inputs(part(tokens), cut(positions), cut(documents))),
                           part(packed)) < 1e-5);
        std::vector<nn::KVCache> caches = model->make_caches(8);
        CHECK_THROWS_WITH_AS(model->forward_cached(part(tokens), caches),
                             doctest::Contains("context group"), Error);
      }
    }
  }

  TEST_CASE("pipeline stages of Llama and GPT-2 (with tensor parallelism) give PyTorch's logits") {
    if (dist::world_size() % 2 != 0) return;
    parallel::ProcessMesh mesh({.tensor = dist::world_size() / 2, .pipeline = 2});
    for (const std::string arch : {"llama", "qwen3", "mistral", "gemma2", "gemma3", "mixtral",
                                   "qwen3_moe", "qwen2_moe", "gpt2"}) {
      CAPTURE(arch);
      const std::string dir = kData + arch;
      const auto config = data::hf::read_config(dir);
      auto stage = split_model(
          config, mesh.tensor(),
          {.gather_logits = true, .stage = mesh.pipeline_rank(), .stages = mesh.shape().pipeline});
      const auto stats = parallel::load_pretrained(*stage, config, dir);
      bool embedding = false;
      for (const auto& [name, p] : stage->named_parameters()) {  // the whole model's names
        if (config.layers == 2)  // one block a stage (Gemma 3's three: two on the first)
          CHECK(name.starts_with(mesh.pipeline_rank() == 0 ? "blocks.0." : "blocks.1.") ==
                name.starts_with("blocks."));
        embedding = embedding || name == "tokens.weight" || name == "embedding.weight";
      }
      if (!config.tie_embeddings) {  // its blocks, not all
        CHECK(uint64_t(stats.bytes_read) < checkpoint_bytes(dir) * 3 / 4);
        CHECK(embedding == (mesh.pipeline_rank() == 0));
      } else {  // a tied head's last stage holds the token embedding too (GPT-2's, Gemma's)
        CHECK(embedding);
      }
      parallel::Pipeline pipe(*stage, {.microbatches = 2, .group = mesh.pipeline()});
      const auto [tokens, expected] = reference_logits(dir);
      const Tensor logits = pipe.predict(tokens);
      if (pipe.is_last()) CHECK(max_abs_diff(logits, expected) < 1e-5);
      std::vector<nn::KVCache> caches = stage->make_caches(8);
      CHECK_THROWS_WITH_AS(stage->forward_cached(tokens, caches),
                           doctest::Contains("pipeline stages"), Error);
    }
  }
}

// Hugging Face checkpoints loaded over ranks: a tensor-parallel Llama whose ranks read only
// their slices, and a fully sharded one loaded whole and then sharded, against the logits
// PyTorch computed (tests/data/hf, written by bench/pretrained/hf_reference.py); tensor-parallel
// greedy decoding against one process's.
#include <doctest/doctest.h>

#include <filesystem>

#include "weave/weave.h"

using namespace weave;

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

uint64_t checkpoint_bytes(const std::string& dir) {
  uint64_t bytes = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    if (entry.path().filename().string().starts_with("model-"))
      for (const auto& e : data::read_safetensors_header(entry.path().string()).entries)
        bytes += e.end - e.begin;
  return bytes;
}

// The tensor-parallel model of a checkpoint's architecture.
std::shared_ptr<nn::CausalLM> split_model(const data::hf::ModelConfig& config, bool gather) {
  if (config.architecture == data::hf::Architecture::GPT2)
    return std::make_shared<parallel::ParallelGPT2Model>(data::hf::gpt2_options(config),
                                                         dist::world(), gather);
  return std::make_shared<parallel::ParallelLlamaModel>(data::hf::llama_options(config),
                                                        dist::world(), gather);
}

}  // namespace

TEST_SUITE("pretrained") {
  TEST_CASE("tensor-parallel GPT-2 and Llama read their slices and give PyTorch's logits") {
    for (const std::string arch : {"gpt2", "llama"}) {
      CAPTURE(arch);
      const std::string dir = kData + arch;
      const auto config = data::hf::read_config(dir);
      auto model = split_model(config, /*gather=*/true);
      const auto stats = parallel::load_pretrained(*model, config, dir);
      const auto [tokens, expected] = reference_logits(dir);
      NoGradGuard no_grad;
      CHECK(max_abs_diff((*model)(tokens), expected) < 1e-5);
      // Norms, GPT-2's position embedding and biases of row-parallel layers, and Llama's kv
      // with fewer key/value heads than ranks, are whole on every rank; the rest is a share.
      if (dist::world_size() > 1) CHECK(uint64_t(stats.bytes_read) < checkpoint_bytes(dir) * 3 / 4);
    }
  }

  TEST_CASE("tensor-parallel greedy decoding gives one process's tokens") {
    for (const std::string arch : {"gpt2", "llama"}) {
      CAPTURE(arch);
      const std::string dir = kData + arch;
      const auto config = data::hf::read_config(dir);
      auto split = split_model(config, false);
      parallel::load_pretrained(*split, config, dir);
      auto whole = data::hf::from_pretrained(dir);
      const Tensor prompt =
          from_vector(std::vector<int64_t>{5, 17, 300, 42, 7, 99, 1, 2, 3, 4}, {2, 5});
      const nn::GenerationOptions greedy{.max_new_tokens = 64};
      CHECK(max_abs_diff(nn::generate(*split, prompt, greedy),
                         nn::generate(*whole, prompt, greedy)) == 0);
    }
  }

  TEST_CASE("fully sharded GPT-2 and Llama, loaded whole and then sharded, give PyTorch's logits") {
    for (const std::string arch : {"gpt2", "llama"}) {
      CAPTURE(arch);
      auto model = data::hf::from_pretrained(kData + arch);
      // GPT-2's tied head reads the token embedding after the blocks: it stays in the root.
      const auto* gpt2 = dynamic_cast<nn::GPT2Model*>(model.get());
      parallel::FullyShardedDataParallel fsdp(
          *model,
          {.units = gpt2 ? gpt2->units() : std::vector<std::string>{}, .group = dist::world()});
      const auto [tokens, expected] = reference_logits(kData + arch);
      NoGradGuard no_grad;
      CHECK(max_abs_diff(fsdp(tokens), expected) < 1e-5);
    }
  }
}

// Hugging Face checkpoints loaded over ranks: a tensor-parallel Llama whose ranks read only
// their slices, and a fully sharded one loaded whole and then sharded, against the logits
// PyTorch computed (tests/data/hf, written by bench/pretrained/hf_reference.py); tensor-parallel
// greedy decoding against one process's.
#include <doctest/doctest.h>

#include <filesystem>

#include "weave/weave.h"

using namespace weave;

namespace {

const std::string kLlama = std::string(WEAVE_TEST_DATA_DIR) + "/hf/llama";

double max_abs_diff(const Tensor& a, const Tensor& b) {
  return max(abs(a.to(kFloat64) - b.to(kFloat64))).item<double>();
}

std::pair<Tensor, Tensor> reference_logits() {
  Tensor tokens, logits;
  for (const auto& [name, t] : data::load_safetensors(kLlama + "/logits.safetensors").tensors)
    (name == "tokens" ? tokens : logits) = t;
  return {tokens, logits};
}

uint64_t checkpoint_bytes() {
  uint64_t bytes = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kLlama))
    if (entry.path().filename().string().starts_with("model-"))
      for (const auto& e : data::read_safetensors_header(entry.path().string()).entries)
        bytes += e.end - e.begin;
  return bytes;
}

}  // namespace

TEST_SUITE("pretrained") {
  TEST_CASE("a tensor-parallel Llama reads its slices and gives PyTorch's logits") {
    const auto config = data::hf::read_config(kLlama);
    parallel::ParallelLlamaModel model(data::hf::llama_options(config), dist::world(),
                                       /*gather_logits=*/true);
    const auto stats = parallel::load_pretrained(model, config, kLlama);
    const auto [tokens, expected] = reference_logits();
    NoGradGuard no_grad;
    CHECK(max_abs_diff(model(tokens), expected) < 1e-5);
    // The norms (and, with fewer key/value heads than ranks, kv) are whole on every rank; the
    // rest is this rank's share.
    if (dist::world_size() > 1) CHECK(uint64_t(stats.bytes_read) < checkpoint_bytes() * 3 / 4);
  }

  TEST_CASE("tensor-parallel greedy decoding gives one process's tokens") {
    const auto config = data::hf::read_config(kLlama);
    parallel::ParallelLlamaModel split(data::hf::llama_options(config), dist::world());
    parallel::load_pretrained(split, config, kLlama);
    auto whole = data::hf::from_pretrained(kLlama);
    const Tensor prompt =
        from_vector(std::vector<int64_t>{5, 17, 300, 42, 7, 99, 1, 2, 3, 4}, {2, 5});
    const nn::GenerationOptions greedy{.max_new_tokens = 64};
    CHECK(max_abs_diff(nn::generate(split, prompt, greedy), nn::generate(*whole, prompt, greedy)) ==
          0);
  }

  TEST_CASE("a fully sharded Llama, loaded whole and then sharded, gives PyTorch's logits") {
    auto model = data::hf::from_pretrained(kLlama);
    parallel::FullyShardedDataParallel fsdp(*model, {.group = dist::world()});
    const auto [tokens, expected] = reference_logits();
    NoGradGuard no_grad;
    CHECK(max_abs_diff(fsdp(tokens), expected) < 1e-5);
  }
}

#pragma once
// GPT-2: learned token and position embeddings, pre-LayerNorm blocks with the tanh GELU, a final
// LayerNorm, and a head tied to the token embedding (Hugging Face's GPT2LMHeadModel; a GPT-2
// checkpoint loads into it through data::hf).
//
//   nn::GPT2Model gpt2({.vocab = 50257, .dim = 768, .layers = 12, .heads = 12});
//   Tensor logits = gpt2(tokens);                    // [B, T] -> [B, T, 50257]
//   Tensor text = nn::generate(gpt2, prompt, {.max_new_tokens = 40});
#include "weave/nn/generation.h"

namespace weave::nn {

struct GPT2ModelOptions {
  int64_t vocab = 50257;
  int64_t dim = 768;
  int64_t layers = 12;
  int64_t heads = 12;
  int64_t max_positions = 1024;  // the position embedding's rows
  /// A head of its own instead of the token embedding's weight.
  bool untied_head = false;
  Generator* generator = nullptr;
  /// Activation checkpointing of every block (Megatron's full recomputation, one block at a
  /// time): backward keeps each block's input and runs the block again when it gets there. The
  /// gradients are bitwise the plain run's. ParallelGPT2Model honors it too.
  bool recompute_blocks = false;
};

class GPT2Model : public CausalLM {
 public:
  explicit GPT2Model(GPT2ModelOptions options = {});
  /// tokens [B, T] (T <= max_positions) -> logits [B, T, vocab], at positions 0 .. T-1.
  Tensor forward(const Tensor& tokens) override;
  int64_t vocab() const override { return options_.vocab; }
  std::vector<KVCache> make_caches(int64_t max_length) const override;
  Tensor forward_cached(const Tensor& tokens, std::vector<KVCache>& caches) override;
  const GPT2ModelOptions& options() const { return options_; }
  /// FSDP's units (FSDPOptions::units): each block, the position embedding and the final norm.
  /// The token embedding stays with the root, since the tied head reads it after the blocks.
  std::vector<std::string> shard_units() const override;

  std::shared_ptr<Embedding> tokens, positions;
  std::vector<std::shared_ptr<TransformerBlock>> blocks;  // named "blocks.<i>"
  std::shared_ptr<LayerNorm> norm;
  std::shared_ptr<Linear> head;  // null unless untied_head

 private:
  Tensor run(const Tensor& tokens, std::vector<KVCache>* caches);
  GPT2ModelOptions options_;
};

}  // namespace weave::nn

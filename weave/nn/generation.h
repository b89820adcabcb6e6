#pragma once
// Language models that decode with key/value caches, and text generation over them: greedy,
// temperature, top-k and top-p sampling, batched, reproducible from a seed.
//
//   models::Llama model(...);                                   // or models::GPT2
//   Tensor out = nn::generate(model, prompt, {.max_new_tokens = 64, .temperature = 0.8,
//                                             .top_p = 0.95, .seed = 7});
//   // prompt [B, T0] int64 -> out [B, T0 + 64]: each row's prompt, then its new tokens
//
// Every step after the prompt runs the model on one new position per row: the caches hold the
// keys and values of every earlier one.
#include <optional>
#include <vector>

#include "weave/nn/transformer.h"

namespace weave::nn {

/// A decoder-only language model: tokens [B, T] -> logits [B, T, vocab], and the same for
/// tokens that follow the positions its caches hold (one cache per attention layer).
class CausalLM : public Module {
 public:
  using Module::Module;
  virtual int64_t vocab() const = 0;
  /// Empty caches for every attention layer, for sequences of up to max_length positions.
  virtual std::vector<KVCache> make_caches(int64_t max_length) const = 0;
  /// Logits of `tokens`, which sit after the caches' positions (appended to them). Inference:
  /// records nothing for autograd.
  virtual Tensor forward_cached(const Tensor& tokens, std::vector<KVCache>& caches) = 0;
  /// The last forward's auxiliary losses (a mixture of experts' load balancing), summed: add
  /// it to the training loss. Undefined when the model has none.
  virtual Tensor aux_loss() const { return Tensor(); }
  /// Activation checkpointing of every block from the next forward on (Hugging Face's
  /// gradient_checkpointing_enable()): the one switch of recomputation, for a model built here
  /// or loaded (models::from_pretrained).
  void set_recompute_blocks(bool recompute) { recompute_blocks_ = recompute; }
  bool recompute_blocks() const { return recompute_blocks_; }

 protected:
  /// The blocks on inputs, each recomputed in backward under set_recompute_blocks (Megatron's
  /// full recomputation, one block at a time: backward keeps each block's input and side inputs
  /// and runs the block again when it gets there, its collectives included; the gradients are
  /// bitwise the plain run's).
  Tensor run_blocks(Sequential& blocks, const Inputs& inputs) {
    return recompute_blocks_ ? blocks.forward_checkpointed(inputs) : blocks(inputs);
  }
  bool recompute_blocks_ = false;
};

struct GenerationOptions {
  int64_t max_new_tokens = 64;
  /// 0: greedy (the most likely token; the lowest id among equals). Otherwise the logits are
  /// divided by it before sampling.
  double temperature = 0.0;
  /// Sample among the k most likely tokens only (0: all).
  int64_t top_k = 0;
  /// Sample among the most likely tokens whose probabilities sum to at least top_p (nucleus
  /// sampling; 1: all). Applied after top_k.
  double top_p = 1.0;
  /// Seeds the sampling (the same seed, model and prompt give the same tokens).
  uint64_t seed = 0;
  /// A row that produces it stops there: its later tokens are this id too. Generation ends
  /// early once every row has stopped.
  std::optional<int64_t> end_of_text{};
};

/// prompt [B, T0] (int64, every row T0 tokens) -> [B, T0 + max_new_tokens] on the prompt's
/// device (fewer new tokens when every row stopped at end_of_text).
Tensor generate(CausalLM& model, const Tensor& prompt, const GenerationOptions& options = {});

/// One token per row from logits [B, vocab] (int64 [B]), as generate draws them; `draws` gives
/// each row's uniform number in [0, 1) (unused when greedy).
Tensor sample_tokens(const Tensor& logits, const GenerationOptions& options,
                     const std::vector<double>& draws);

}  // namespace weave::nn

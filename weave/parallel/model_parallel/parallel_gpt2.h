#pragma once
// GPT-2 (nn::GPT2Model) over a tensor-parallel group, with the same parameter names: the token
// embedding split by vocabulary rows (VocabParallelEmbedding) and the head tied to that slice,
// the position embedding and the final LayerNorm whole, ParallelTransformerBlocks between.
//
//   parallel::ParallelGPT2Model gpt2(options, mesh.tensor());
//   parallel::load_pretrained(gpt2, data::hf::read_config(dir), dir);   // this rank's slices
//   Tensor logits = gpt2(tokens);   // [B, T, vocab / n]: this rank's vocabulary slice
#include "weave/nn/gpt2.h"
#include "weave/parallel/model_parallel/parallel_transformer.h"
#include "weave/parallel/model_parallel/tensor_parallel.h"

namespace weave::parallel {

class ParallelGPT2Model : public nn::CausalLM {
 public:
  /// gather_logits: forward gives every rank all of the logits (decoding always does).
  ParallelGPT2Model(nn::GPT2ModelOptions options, dist::Group group, bool gather_logits = false);
  Tensor forward(const Tensor& tokens) override;
  int64_t vocab() const override { return options_.vocab; }
  std::vector<nn::KVCache> make_caches(int64_t max_length) const override;
  Tensor forward_cached(const Tensor& tokens, std::vector<nn::KVCache>& caches) override;

  std::shared_ptr<VocabParallelEmbedding> tokens;
  std::shared_ptr<nn::Embedding> positions;
  std::vector<std::shared_ptr<ParallelTransformerBlock>> blocks;  // named "blocks.<i>"
  std::shared_ptr<nn::LayerNorm> norm;

 private:
  Tensor run(const Tensor& tokens, std::vector<nn::KVCache>* caches, bool gather);
  nn::GPT2ModelOptions options_;
  dist::Group group_;
  bool gather_logits_;
};

}  // namespace weave::parallel

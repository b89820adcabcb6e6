#pragma once
// GPT-2 (nn::GPT2Model) over a tensor-parallel group, with the same parameter names: the token
// embedding split by vocabulary rows (VocabParallelEmbedding) and the head tied to that slice,
// the position embedding and the final LayerNorm whole, ParallelTransformerBlocks between. A
// vocabulary that does not divide among the ranks is padded (padded_vocab: GPT-2's 50257 to
// 50304), its padding masked out of the logits; the parameters are then the padded ones.
//
//   parallel::ParallelGPT2Model gpt2(options, mesh.tensor());
//   parallel::load_pretrained(gpt2, data::hf::read_config(dir), dir);   // this rank's slices
//   Tensor logits = gpt2(tokens);   // [B, T, padded / n]: this rank's vocabulary slice
//
// With a context group (ParallelLMOptions) each rank passes its part of every sequence and the
// position embedding reads the part's positions. As pipeline stage s of S (ParallelLMOptions),
// the first stage embeds, the last holds the final norm and the head, hidden states [B, T, dim]
// travel between, and the last stage's copy of the token embedding is tied to the first's:
// parallel::Pipeline adds their gradients after each step (Megatron-LM's shared embedding).
#include "weave/nn/gpt2.h"
#include "weave/parallel/model_parallel/parallel_transformer.h"
#include "weave/parallel/model_parallel/tensor_parallel.h"

namespace weave::parallel {

class ParallelGPT2Model : public nn::CausalLM {
 public:
  ParallelGPT2Model(nn::GPT2ModelOptions options, dist::Group group, ParallelLMOptions split = {});
  Tensor forward(const Tensor& tokens) override;
  int64_t vocab() const override { return options_.vocab; }
  std::vector<nn::KVCache> make_caches(int64_t max_length) const override;
  Tensor forward_cached(const Tensor& tokens, std::vector<nn::KVCache>& caches) override;
  /// With split.moe: the last forward's load-balancing and z-losses of the blocks, summed (add
  /// it to the loss); undefined without experts.
  Tensor aux_loss() const;
  /// This stage's position embedding, blocks and final norm, each a unit of its own (the token
  /// embedding stays with the root: the tied head reads it after the blocks).
  std::vector<std::string> shard_units() const override;

  /// On the first stage and the last (whose head multiplies by it: a copy tied to the first
  /// stage's, tie_first_and_last_stage); null between.
  std::shared_ptr<VocabParallelEmbedding> tokens;
  std::shared_ptr<nn::Embedding> positions;                       // the first stage's
  std::vector<std::shared_ptr<ParallelTransformerBlock>> blocks;  // this stage's, "blocks.<i>"
  std::shared_ptr<nn::LayerNorm> norm;                            // the last stage's

 private:
  Tensor embed(const Tensor& ids, int64_t start);
  Tensor run(const Tensor& input, std::vector<nn::KVCache>* caches, bool gather);
  nn::GPT2ModelOptions options_;
  dist::Group group_;
  ParallelLMOptions split_;
};

}  // namespace weave::parallel

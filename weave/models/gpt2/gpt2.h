#pragma once
// GPT-2: learned token and position embeddings, pre-LayerNorm blocks with the tanh GELU, a final
// LayerNorm, and a head tied to the token embedding (Hugging Face's GPT2LMHeadModel); one class
// whether whole or split over ranks (models::ModelSplit: tensor, context, pipeline and expert
// parallelism, and sequence parallelism inside the tensor group). The options also give the
// original GPT's variants (the exact GELU, a head of its own with a bias).
//
//   models::GPT2 gpt2({.vocab = 50257, .dim = 768, .layers = 12, .heads = 12});
//   Tensor logits = gpt2(tokens);                    // [B, T] -> [B, T, 50257]
//   Tensor text = nn::generate(gpt2, prompt, {.max_new_tokens = 40});
//
//   models::GPT2 part(options, models::ModelSplit::from_mesh(mesh));   // this rank's slices
//
// Split over a tensor group, the token embedding splits by vocabulary rows
// (parallel::VocabParallelEmbedding) and the head reads that slice: forward gives this rank's
// vocabulary slice of the logits unless split.gather_logits (with split.vocabulary, over the
// shard group too: the slice of every batch rank's rows,
// parallel/model_parallel/tensor_parallel_vocabulary.h), a vocabulary that does not divide among
// the ranks padded (parallel::padded_vocab: 50257 to 50304) and masked out of them; the blocks are
// nn::TransformerBlocks built with the split's leaves, batch first (sequence parallelism cuts dim
// 1), experts in place of their MLPs with options.moe. As pipeline stage s of S the first stage
// embeds, the last holds the final norm and the head, hidden states [B, T, dim] travel between, and
// the last stage's copy of the token embedding is tied to the first's: parallel::Pipeline adds
// their gradients after each step (Megatron-LM's shared embedding).
#include "weave/data/hf/model_config.h"
#include "weave/models/model_split.h"
#include "weave/nn/generation.h"

namespace weave::models {

struct GPT2Options {
  int64_t vocab = 50257;
  int64_t dim = 768;
  int64_t layers = 12;
  int64_t heads = 12;
  int64_t max_positions = 1024;  // the position embedding's rows
  /// GELU's tanh approximation (GPT-2's); false: the exact (erf) GELU.
  bool tanh_gelu = true;
  /// A head of its own instead of the token embedding's weight (split over a tensor group by
  /// vocabulary columns, as the embedding by rows), with a bias when head_bias.
  bool untied_head = false;
  bool head_bias = false;
  /// A mixture of experts in place of every block's MLP (moe->hidden is dim), block i's seeded
  /// moe->seed + i. While training, each block's balancing loss travels with its output into
  /// backward (nn::MoE::with_aux_loss), on every pipeline stage: the trainer adds nothing.
  std::optional<nn::MoEOptions> moe = std::nullopt;
  Generator* generator = nullptr;
};

class GPT2 : public nn::CausalLM {
 public:
  explicit GPT2(GPT2Options options = {}, ModelSplit split = {});
  /// tokens [B, T] (T <= max_positions) -> logits [B, T, vocab], at positions 0 .. T-1 (this
  /// rank's part of them with a context group); a later stage takes hidden states.
  Tensor forward(const Tensor& tokens) override;
  int64_t vocab() const override { return options_.vocab; }
  std::vector<nn::KVCache> make_caches(int64_t max_length) const override;
  Tensor forward_cached(const Tensor& tokens, std::vector<nn::KVCache>& caches) override;
  /// FSDP's units: this stage's embeddings, each block, the final norm and an untied head. A
  /// tied token embedding stays with the root, since the head reads it after the blocks.
  std::vector<std::string> shard_units() const override;
  /// With experts: the last forward's load-balancing and z-losses of this stage's blocks, summed,
  /// for reporting (backward already differentiates them); undefined without experts.
  Tensor aux_loss() const override;
  const GPT2Options& options() const { return options_; }
  const ModelSplit& split() const { return split_; }
  /// The token embedding's table (this rank's vocabulary rows when split).
  Tensor& token_weight();

  /// nn::Embedding or parallel::VocabParallelEmbedding, on the first stage and the last (whose
  /// head multiplies by it: in a pipeline a copy tied to the first stage's); null between.
  std::shared_ptr<nn::Module> tokens;
  std::shared_ptr<nn::Embedding> positions;  // the first stage's
  /// This stage's nn::TransformerBlocks (split by the split's leaves).
  std::shared_ptr<nn::Sequential> blocks;
  /// The last stage's nn::LayerNorm (parallel::SequenceParallelLayerNorm under sequence
  /// parallelism).
  std::shared_ptr<nn::Module> norm;
  /// nn::Linear, or parallel::VocabParallelHead over the vocabulary; null unless untied_head.
  std::shared_ptr<nn::Module> head;

 private:
  void add_blocks();
  void add_head();
  Tensor embed(const Tensor& ids, int64_t start);
  Tensor run(const Tensor& input, std::vector<nn::KVCache>* caches, bool gather);
  Tensor logits(const Tensor& hidden, bool gather);
  GPT2Options options_;
  ModelSplit split_;
  Tensor* token_weight_ = nullptr;
};

/// The options of a Hugging Face GPT-2 configuration (GPT2LMHeadModel).
GPT2Options gpt2_options(const data::hf::ModelConfig& config, Generator* generator = nullptr);
/// The configuration of a model built from its options, to export it; raises for an untied
/// head (Hugging Face's GPT-2 ties it).
data::hf::ModelConfig model_config(const GPT2Options& options, DType dtype = kFloat32);

}  // namespace weave::models

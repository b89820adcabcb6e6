#pragma once
// examples/gpt's models: one process's GPT (each data-parallel replica), the same GPT split over
// a tensor-parallel group or a context group, and the GPT whose MLPs are mixtures of experts.
// Every variant has the parameter names of the whole model it splits, so one initialization
// (on the whole model, by name order) starts them all equal.
#include <weave/weave.h>

#include "flags.h"

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace gpt {

namespace F = dist::functional;

/// A GPT however it is split: logits from ids, the loss of those logits, and decoding.
class LanguageModel : public nn::Module {
 public:
  using nn::Module::Module;
  /// Mean cross-entropy of forward(ids)'s logits against targets [B, T].
  virtual Tensor loss(const Tensor& logits, const Tensor& targets) = 0;
  /// The next token's logits [B, vocab] on every rank, extending one cache per block.
  virtual Tensor decode(const Tensor& ids, std::vector<nn::KVCache>& caches) = 0;

  /// Recompute each block in backward instead of keeping its activations (the Llamas hand it
  /// to the library's model: set_recompute_blocks).
  bool checkpoint_activations = false;

 protected:
  Tensor run_block(nn::Module& block, const Tensor& x) {
    return checkpoint_activations ? nn::checkpointed(block, nn::Inputs(x)) : block(x);
  }
};

// Token plus position embeddings of ids [B, T] sitting at positions start, start + 1, ...
Tensor embed_at(nn::Module& tokens, nn::Embedding& positions, const Tensor& ids, int64_t start) {
  return tokens(ids) + positions(position_ids(start, ids.size(1), ids.device()));
}

/// The library's Llama of the flags.
inline models::LlamaOptions llama_options(const Flags& f, int64_t vocab) {
  return {.vocab = vocab,
          .dim = f.dim,
          .layers = f.layers,
          .block = {.heads = f.heads, .kv_heads = f.kv_heads, .hidden = f.ffn}};
}

inline parallel::ContextParallelMode context_mode(const Flags& f) {
  return f.cp_mode == "ring" ? parallel::ContextParallelMode::Ring
                             : parallel::ContextParallelMode::AllToAll;
}

/// Block 0's mixture of experts under --experts (models::ModelSplit seeds block i's + i).
inline std::optional<nn::MoEOptions> llama_experts(const Flags& f);

/// The model's FSDP units (its shard_units()) under the name it is registered by.
inline std::vector<std::string> prefixed(const std::string& prefix, const nn::Module& model) {
  std::vector<std::string> names;
  for (const std::string& unit : model.shard_units()) names.push_back(prefix + "." + unit);
  return names;
}

/// A Llama-class model (models::Llama: RMSNorm, rotary positions, grouped-query attention,
/// SwiGLU, untied head) as one process's language model; packed windows bring their positions
/// and document ids (nn::Inputs) to every block.
class Llama : public LanguageModel {
 public:
  Llama(const Flags& f, int64_t vocab) : LanguageModel("Llama") {
    model = register_module("llama", std::make_shared<models::Llama>(llama_options(f, vocab)));
    model->set_recompute_blocks(f.checkpoint_activations);
  }
  Tensor forward(const Tensor& ids) override { return forward_inputs(ids); }
  Tensor forward_inputs(const nn::Inputs& inputs) override { return model->forward_inputs(inputs); }
  Tensor loss(const Tensor& logits, const Tensor& targets) override {
    return cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
  }
  std::vector<std::string> shard_units() const override { return prefixed("llama", *model); }
  Tensor decode(const Tensor& ids, std::vector<nn::KVCache>& caches) override {
    const Tensor logits = model->forward_cached(ids, caches);
    return logits.select(1, logits.size(1) - 1);
  }
  std::shared_ptr<models::Llama> model;
};

/// One process's GPT (also each DDP replica): [B, T] ids -> [B, T, vocab] logits.
class Gpt : public LanguageModel {
 public:
  Gpt(const Flags& f, int64_t vocab) : LanguageModel("Gpt") {
    tokens = register_module("tokens", std::make_shared<nn::Embedding>(vocab, f.dim));
    positions = register_module("positions", std::make_shared<nn::Embedding>(f.context, f.dim));
    for (int64_t i = 0; i < f.layers; ++i)
      blocks.push_back(register_module("block" + std::to_string(i),
                                       std::make_shared<nn::TransformerBlock>(f.dim, f.heads)));
    norm = register_module("norm", std::make_shared<nn::LayerNorm>(Shape{f.dim}));
    head = register_module("head", std::make_shared<nn::Linear>(f.dim, vocab));
  }
  Tensor forward(const Tensor& ids) override {
    Tensor x = embed(ids, 0);
    for (auto& block : blocks) x = run_block(*block, x);
    return (*head)((*norm)(x));
  }
  Tensor loss(const Tensor& logits, const Tensor& targets) override {
    return cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
  }
  Tensor decode(const Tensor& ids, std::vector<nn::KVCache>& caches) override {
    Tensor x = embed(ids, caches[0].length());
    for (size_t i = 0; i < blocks.size(); ++i)  // between its hooks: fsdp gathers the block
      x = blocks[i]->call(
          x, [&](const nn::Inputs& in) { return blocks[i]->forward(in.x, caches[i]); });
    return (*head)((*norm)(x.select(1, x.size(1) - 1)));
  }
  std::shared_ptr<nn::Embedding> tokens, positions;
  std::vector<std::shared_ptr<nn::TransformerBlock>> blocks;
  std::shared_ptr<nn::LayerNorm> norm;
  std::shared_ptr<nn::Linear> head;

 private:
  Tensor embed(const Tensor& ids, int64_t start) {
    return embed_at(*tokens, *positions, ids, start);
  }
};

/// Block i's mixture of experts: --experts of them, each a 4 dim / K MLP (a token costs the dense
/// MLP's compute), top --top-k.
inline nn::MoEOptions moe_options(const Flags& f, int64_t i) {
  return {.hidden = f.dim,
          .ffn = 4 * f.dim / f.top_k,
          .router = {.experts = f.experts, .top_k = f.top_k},
          .seed = f.seed + uint64_t(i)};
}

inline std::optional<nn::MoEOptions> llama_experts(const Flags& f) {
  return f.experts > 0 ? std::optional(moe_options(f, 0)) : std::nullopt;
}

/// The part of the model a pipeline stage holds: blocks [first, last), the embeddings on the
/// first stage, the final norm and the head on the last (the whole model by default).
struct StageRange {
  int64_t first = 0, last = -1;  // -1: every block
  bool embeds = true, heads = true;
};

/// Stage `stage` of `stages`: an equal share of the blocks (the first stages take one more when
/// they do not divide).
inline StageRange stage_range(int64_t layers, int stage, int stages) {
  auto start = [&](int s) { return layers * s / stages; };
  return {.first = start(stage),
          .last = start(stage + 1),
          .embeds = stage == 0,
          .heads = stage == stages - 1};
}

/// The same GPT split over a tensor-parallel group: the vocabulary of the embedding and of the
/// output layer, the heads and MLP units of every block. Sequence first inside; with sequence
/// parallelism the norms and residuals hold 1/n of the sequence. Same parameter names as Gpt.
class ParallelGpt : public LanguageModel {
 public:
  /// With `context`, each rank of that group holds its zig-zag part of every sequence
  /// (parallel::ring_attention or all_to_all_attention, per --cp-mode). With --experts, every
  /// block's MLP is a mixture of experts (as MoeGpt's), spread over `experts` when it has
  /// several ranks, its load-balancing loss over `balance` (the data x context ranks). With a
  /// `range`, only that pipeline stage's part: forward then maps what the previous stage sent
  /// (ids on the first) to what the next one takes (logits on the last).
  ParallelGpt(const Flags& f, int64_t vocab, const dist::Group& tp, bool sequence_parallel,
              std::optional<dist::Group> context = std::nullopt,
              std::optional<dist::Group> experts = std::nullopt,
              std::optional<dist::Group> balance = std::nullopt, StageRange range = {})
      : LanguageModel("ParallelGpt"),
        tp_(tp),
        sequence_parallel_(sequence_parallel),
        context_(std::move(context)),
        range_(range) {
    if (range_.last < 0) range_.last = f.layers;
    if (range_.embeds) {
      tokens = register_module(
          "tokens", std::make_shared<parallel::VocabParallelEmbedding>(vocab, f.dim, tp));
      positions = register_module("positions", std::make_shared<nn::Embedding>(f.context, f.dim));
    }
    for (int64_t i = range_.first; i < range_.last; ++i)
      blocks.push_back(register_module(
          "block" + std::to_string(i),
          std::make_shared<parallel::ParallelTransformerBlock>(
              f.dim, f.heads, tp,
              parallel::ParallelTransformerBlockOptions{
                  .sequence_parallel = sequence_parallel,
                  .context = context_
                                 ? std::optional(parallel::ContextSplit{*context_, context_mode(f)})
                                 : std::nullopt,
                  .moe = f.experts > 0 ? std::optional(moe_options(f, i)) : std::nullopt,
                  .expert_group = experts,
                  .balance_group = balance})));
    if (!range_.heads) return;
    if (sequence_parallel)
      norm = register_module(
          "norm", std::make_shared<parallel::SequenceParallelLayerNorm>(Shape{f.dim}, tp));
    else
      norm = register_module("norm", std::make_shared<nn::LayerNorm>(Shape{f.dim}));
    head = register_module(
        "head", std::make_shared<parallel::ColumnParallelLinear>(
                    f.dim, vocab, tp,
                    parallel::ColumnParallelOptions{.sequence_parallel = sequence_parallel}));
  }
  /// ids [B, T] -> this rank's vocabulary slice of the logits, [T, B, vocab / n]; a pipeline
  /// stage maps its input (ids or hidden states [T, B, dim]) to its output likewise.
  Tensor forward(const Tensor& input) override {
    Tensor x = input;
    if (range_.embeds) {
      x = embed(input, 0);
      if (sequence_parallel_) x = F::scatter_to_group(x, 0, tp_);  // this rank's positions
    }
    for (auto& block : blocks) x = run_block(*block, x);
    return range_.heads ? (*head)((*norm)(x)) : x;
  }
  /// Cross-entropy, plus every block's auxiliary loss with experts.
  Tensor loss(const Tensor& logits, const Tensor& targets) override {
    const Tensor mine = context_ ? part(targets) : targets;  // this rank's positions
    Tensor total = parallel::vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                                          mine.transpose(0, 1).reshape({-1}), tp_);
    if (is_training())
      for (auto& block : blocks)
        if (block->moe) total = total + block->aux_loss();
    return total;
  }
  Tensor decode(const Tensor& ids, std::vector<nn::KVCache>& caches) override {
    Tensor x = embed(ids, caches[0].length());
    for (size_t i = 0; i < blocks.size(); ++i)  // between its hooks: fsdp gathers the block
      x = blocks[i]->call(
          x, [&](const nn::Inputs& in) { return blocks[i]->forward(in.x, caches[i]); });
    Tensor local = (*head)((*norm)(x.select(0, x.size(0) - 1)));  // [B, vocab / n]
    return F::all_gather(local, -1, tp_);
  }
  std::shared_ptr<parallel::VocabParallelEmbedding> tokens;
  std::shared_ptr<nn::Embedding> positions;
  std::vector<std::shared_ptr<parallel::ParallelTransformerBlock>> blocks;
  std::shared_ptr<nn::Module> norm;
  std::shared_ptr<parallel::ColumnParallelLinear> head;

 private:
  // [B, T] ids -> [T, B, dim] (this rank's positions only, under context parallelism)
  Tensor embed(const Tensor& ids, int64_t start) {
    if (!context_) return embed_at(*tokens, *positions, ids, start).transpose(0, 1).contiguous();
    const Tensor where = part(arange(double(start), double(start + ids.size(1)), 1,
                                     {.dtype = kInt64, .device = ids.device()})
                                  .unsqueeze(0));
    return ((*tokens)(part(ids)) + (*positions)(where.squeeze(0))).transpose(0, 1).contiguous();
  }
  // This rank's zig-zag part of a [B, T] tensor, along T.
  Tensor part(const Tensor& x) const {
    return parallel::shard_sequence(x, 1, *context_, parallel::SequenceLayout::ZigZag);
  }
  dist::Group tp_;
  bool sequence_parallel_;
  std::optional<dist::Group> context_;
  StageRange range_;
};

/// The library's Llama split over a tensor-parallel group (and its attention over a context
/// group), or a pipeline stage's part of it: models::Llama under "llama", so its
/// names are Llama's and one initialization on the whole model starts it. Batch first:
/// [B, T / cp, vocab slice] logits of this rank's positions (zig-zag parts).
class ParallelLlama : public LanguageModel {
 public:
  /// As `split` says (models::ModelSplit::from_mesh: its tensor group, context group, pipeline
  /// stage and experts); as a stage, forward maps what the previous stage sent (ids on the
  /// first) to what the next one takes (logits on the last).
  ParallelLlama(const Flags& f, int64_t vocab, models::ModelSplit split)
      : LanguageModel("ParallelLlama"), tp_(*split.tensor), context_(split.context_group) {
    llama = register_module(
        "llama", std::make_shared<models::Llama>(llama_options(f, vocab), std::move(split)));
    llama->set_recompute_blocks(f.checkpoint_activations);
  }
  Tensor forward(const Tensor& ids) override { return forward_inputs(ids); }
  /// ids, positions and document ids of whole windows; each rank takes its part (a later
  /// pipeline stage's hidden states are its part already).
  Tensor forward_inputs(const nn::Inputs& inputs) override {
    return llama->forward_inputs({llama->embedding ? part(inputs.x) : inputs.x,
                                  part(inputs.positions), part(inputs.document_ids)});
  }
  /// Cross-entropy, plus every block's auxiliary loss with experts.
  Tensor loss(const Tensor& logits, const Tensor& targets) override {
    Tensor total = parallel::vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                                          part(targets).reshape({-1}), tp_);
    const Tensor aux = is_training() ? llama->aux_loss() : Tensor();
    return aux.defined() ? total + aux : total;
  }
  std::vector<std::string> shard_units() const override { return prefixed("llama", *llama); }
  /// With the library's key/value caches (built without a context group or stages).
  Tensor decode(const Tensor& ids, std::vector<nn::KVCache>& caches) override {
    const Tensor logits = llama->forward_cached(ids, caches);  // every rank all of them
    return logits.select(1, logits.size(1) - 1);
  }
  std::shared_ptr<models::Llama> llama;

 private:
  // This rank's zig-zag part along T of a [B, T] tensor (undefined stays undefined).
  Tensor part(const Tensor& x) const {
    if (!context_ || !x.defined()) return x;
    return parallel::shard_sequence(x, 1, *context_, parallel::SequenceLayout::ZigZag);
  }
  dist::Group tp_;
  std::optional<dist::Group> context_;
};

/// A pre-LayerNorm block whose MLP is a mixture of experts (nn::MoE on one rank, or
/// parallel::ExpertParallelMoE over an expert group): the same parameter names either way.
class MoeBlock : public nn::Module {
 public:
  MoeBlock(const Flags& f, std::shared_ptr<nn::Module> experts, std::function<Tensor()> aux)
      : nn::Module("MoeBlock"), aux_loss(std::move(aux)) {
    norm1 = register_module("norm1", std::make_shared<nn::LayerNorm>(Shape{f.dim}));
    attention = register_module("attention",
                                std::make_shared<nn::MultiheadAttention>(
                                    f.dim, f.heads, nn::MultiheadAttentionOptions{.causal = true}));
    norm2 = register_module("norm2", std::make_shared<nn::LayerNorm>(Shape{f.dim}));
    moe = register_module("moe", std::move(experts));
  }
  Tensor forward(const Tensor& x) override { return run(x, nullptr); }
  Tensor run(const Tensor& x, nn::KVCache* cache) {
    const Tensor normed = (*norm1)(x);
    const Tensor h = x + (cache ? attention->forward(normed, *cache) : (*attention)(normed));
    return h + (*moe)((*norm2)(h));
  }
  std::shared_ptr<nn::LayerNorm> norm1, norm2;
  std::shared_ptr<nn::MultiheadAttention> attention;
  std::shared_ptr<nn::Module> moe;
  std::function<Tensor()> aux_loss;  // the last forward's load-balancing and z-loss
};

/// Gpt with --experts experts in every block's MLP, top --top-k, on one rank (each data-parallel
/// replica; ParallelGpt spreads them). The load-balancing loss counts the assignments of the
/// whole step's batch (`balance`: the data-parallel ranks).
class MoeGpt : public LanguageModel {
 public:
  MoeGpt(const Flags& f, int64_t vocab, std::optional<dist::Group> balance)
      : LanguageModel("MoeGpt") {
    tokens = register_module("tokens", std::make_shared<nn::Embedding>(vocab, f.dim));
    positions = register_module("positions", std::make_shared<nn::Embedding>(f.context, f.dim));
    for (int64_t i = 0; i < f.layers; ++i) {
      nn::MoEOptions o = moe_options(f, i);
      if (balance && balance->size() > 1) o.reduce_shares = parallel::shares_over(*balance);
      auto dense = std::make_shared<nn::MoE>(o);
      std::function<Tensor()> aux = [raw = dense.get()] { return raw->aux_loss(); };
      std::shared_ptr<nn::Module> layer = dense;
      blocks.push_back(
          register_module("block" + std::to_string(i), std::make_shared<MoeBlock>(f, layer, aux)));
    }
    norm = register_module("norm", std::make_shared<nn::LayerNorm>(Shape{f.dim}));
    head = register_module("head", std::make_shared<nn::Linear>(f.dim, vocab));
  }
  Tensor forward(const Tensor& ids) override {
    Tensor x = embed_at(*tokens, *positions, ids, 0);
    for (auto& block : blocks) x = run_block(*block, x);
    return (*head)((*norm)(x));
  }
  /// Cross-entropy plus every block's auxiliary loss.
  Tensor loss(const Tensor& logits, const Tensor& targets) override {
    Tensor total = cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
    if (is_training())
      for (auto& block : blocks) total = total + block->aux_loss();
    return total;
  }
  Tensor decode(const Tensor& ids, std::vector<nn::KVCache>& caches) override {
    Tensor x = embed_at(*tokens, *positions, ids, caches[0].length());
    for (size_t i = 0; i < blocks.size(); ++i) x = blocks[i]->run(x, &caches[i]);
    return (*head)((*norm)(x.select(1, x.size(1) - 1)));
  }
  std::shared_ptr<nn::Embedding> tokens, positions;
  std::vector<std::shared_ptr<MoeBlock>> blocks;
  std::shared_ptr<nn::LayerNorm> norm;
  std::shared_ptr<nn::Linear> head;
};

}  // namespace gpt

// GPT-2, whole or split: nn/ layers without a tensor group, their tensor-parallel counterparts
// with one (which run sequence first, [T, B, dim]).
#include "weave/models/gpt2/gpt2.h"

#include "weave/autograd/grad_mode.h"
#include "weave/distributed/functional.h"
#include "weave/parallel/core/placement.h"
#include "weave/parallel/model_parallel/context_parallel.h"
#include "weave/parallel/model_parallel/parallel_transformer.h"

namespace weave::models {

namespace {

constexpr const char* kGPT2 = "GPT2";

template <typename Block>
std::function<Tensor(const Tensor&, nn::KVCache&)> decoder_of(Block* block) {
  return [block](const Tensor& x, nn::KVCache& cache) { return block->forward(x, cache); };
}

}  // namespace

GPT2::GPT2(GPT2Options options, ModelSplit split)
    : nn::CausalLM(kGPT2), options_(options), split_(std::move(split)) {
  WEAVE_CHECK(
      options.vocab > 0 && options.dim > 0 && options.layers > 0 && options.max_positions > 0,
      kGPT2, "vocab, dim, layers and max_positions must be positive, found {}, {}, {} and {}",
      options.vocab, options.dim, options.layers, options.max_positions);
  split_.check(kGPT2, options.layers);
  WEAVE_CHECK(!options.untied_head || !split_.tensor, kGPT2,
              "an untied head is not split here; hint: GPT-2 ties it to the token embedding");
  WEAVE_CHECK(!split_.moe || split_.tensor, kGPT2,
              "GPT-2's mixture-of-experts blocks are the tensor-parallel ones; hint: "
              "ModelSplit::from_mesh gives a tensor group (of this rank alone will do)");
  // The last stage's head multiplies by the token embedding: in a pipeline it holds a copy of
  // its own under the same name, tied to the first stage's (Megatron-LM's shared embedding).
  if (split_.first_stage() || (split_.last_stage() && !options.untied_head)) {
    const detail::TokenTable table =
        detail::token_table(options.vocab, options.dim, split_, options.generator);
    tokens = register_module("tokens", table.module);
    token_weight_ = table.weight;
  }
  if (split_.first_stage())
    positions = register_module(
        "positions",
        std::make_shared<nn::Embedding>(options.max_positions, options.dim, options.generator));
  add_blocks();
  if (split_.last_stage()) {
    norm = register_module("norm", std::make_shared<nn::LayerNorm>(Shape{options.dim}));
    if (options.untied_head)
      head = register_module("head", std::make_shared<nn::Linear>(options.dim, options.vocab, false,
                                                                  options.generator));
  }
  if (split_.stages > 1 && tokens) parallel::tie_first_and_last_stage(*token_weight_);
  if (split_.context_group) parallel::record_context_reads(*this, *split_.context_group);
}

void GPT2::add_blocks() {
  const auto [first, last] = split_.stage_blocks(options_.layers);
  blocks = register_module("blocks", std::make_shared<nn::Sequential>(size_t(first)));
  for (int64_t i = first; i < last; ++i) {
    if (split_.tensor) {
      auto block = std::make_shared<parallel::ParallelTransformerBlock>(
          options_.dim, options_.heads, *split_.tensor,
          parallel::ParallelTransformerBlockOptions{.tanh_gelu = true,
                                                    .generator = options_.generator,
                                                    .context = split_.context(),
                                                    .moe = split_.block_experts(i),
                                                    .expert_group = split_.expert_group,
                                                    .balance_group = split_.balance_group});
      cached_blocks_.push_back(decoder_of(block.get()));
      blocks->push_back(block);
    } else {
      auto block = std::make_shared<nn::TransformerBlock>(
          options_.dim, options_.heads,
          nn::TransformerBlockOptions{.tanh_gelu = true, .generator = options_.generator});
      cached_blocks_.push_back(decoder_of(block.get()));
      blocks->push_back(block);
    }
  }
}

Tensor& GPT2::token_weight() {
  WEAVE_CHECK(token_weight_ != nullptr, kGPT2,
              "stage {} of {} holds no token embedding (the first and the last stage do)",
              split_.stage, split_.stages);
  return *token_weight_;
}

Tensor GPT2::forward(const Tensor& ids) {
  return run(ids, nullptr, split_.gather_logits);
}

std::vector<std::string> GPT2::shard_units() const {
  std::vector<std::string> names;
  if (positions) names.push_back("positions");
  for (const auto& [name, block] : blocks->named_children()) names.push_back("blocks." + name);
  if (norm) names.push_back("norm");
  if (head) names.push_back("head");
  return names;
}

Tensor GPT2::aux_loss() const {
  if (!split_.tensor) return Tensor();
  return detail::sum_aux_losses<parallel::ParallelTransformerBlock>(*blocks);
}

std::vector<nn::KVCache> GPT2::make_caches(int64_t max_length) const {
  WEAVE_CHECK(max_length <= options_.max_positions, kGPT2,
              "{} positions exceed the {} the position embedding holds", max_length,
              options_.max_positions);
  return std::vector<nn::KVCache>(blocks->size(), nn::KVCache(max_length));
}

Tensor GPT2::forward_cached(const Tensor& ids, std::vector<nn::KVCache>& caches) {
  split_.check_decoding(kGPT2, caches.size(), blocks->size());
  NoGradGuard no_grad;
  return run(ids, &caches, true);
}

// The token and position embeddings of ids [B, T] sitting after `start` positions (this rank's
// part of each sequence under context parallelism), [B, T, dim].
Tensor GPT2::embed(const Tensor& ids, int64_t start) {
  WEAVE_CHECK(ids.defined() && ids.dim() == 2, kGPT2, "expected tokens [B, T], found {}",
              ids.defined() ? ids.shape() : Shape{});
  const int parts = split_.context_group ? split_.context_group->size() : 1;
  const int64_t length = ids.size(1) * parts;  // the whole sequence's
  WEAVE_CHECK(start + length <= options_.max_positions, kGPT2,
              "positions up to {} exceed the {} the position embedding holds", start + length,
              options_.max_positions);
  Tensor where = position_ids(start, length, ids.device());
  if (parts > 1)
    where = parallel::shard_sequence(where, 0, *split_.context_group, split_.context_layout);
  return (*tokens)(ids) + (*positions)(where);
}

// The tensor-parallel blocks run sequence first ([T, B, dim]); between pipeline stages hidden
// states travel batch first, [B, T, dim].
Tensor GPT2::run(const Tensor& input, std::vector<nn::KVCache>* caches, bool gather) {
  if (!positions) detail::check_stage_input(kGPT2, split_, input, options_.dim);
  Tensor x = positions ? embed(input, caches ? caches->front().length() : 0) : input;
  const bool sequence_first = split_.tensor.has_value();
  if (sequence_first) x = x.transpose(0, 1);
  if (caches) {
    for (size_t i = 0; i < blocks->size(); ++i)  // between its hooks: FSDP gathers the block
      x = (*blocks)[i].call(nn::Inputs(x), [&](const nn::Inputs& in) {
        return cached_blocks_[i](in.x, (*caches)[i]);
      });
  } else {
    x = run_blocks(*blocks, nn::Inputs(x));
  }
  if (sequence_first) x = x.transpose(0, 1);
  if (!norm) return detail::stage_output(x, is_training() && !caches ? aux_loss() : Tensor());
  return logits((*norm)(x), gather);
}

Tensor GPT2::logits(const Tensor& hidden, bool gather) {
  if (!split_.tensor) return head ? (*head)(hidden) : linear(hidden, token_weight());
  // The tied head: this rank's vocabulary rows; the input's gradient sums over the group.
  const Tensor local =
      linear(dist::functional::copy_to_group(hidden, *split_.tensor), token_weight());
  return parallel::vocab_parallel_logits(local, options_.vocab, *split_.tensor, gather);
}

}  // namespace weave::models

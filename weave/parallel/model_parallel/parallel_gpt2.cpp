#include "weave/parallel/model_parallel/parallel_gpt2.h"

#include "weave/autograd/grad_mode.h"
#include "weave/distributed/functional.h"
#include "weave/ops/side_loss.h"
#include "weave/parallel/core/placement.h"

namespace weave::parallel {

ParallelGPT2Model::ParallelGPT2Model(nn::GPT2ModelOptions options, dist::Group group,
                                     ParallelLMOptions split)
    : nn::CausalLM("ParallelGPT2Model"),
      options_(options),
      group_(std::move(group)),
      split_(std::move(split)) {
  recompute_blocks_ = options.recompute_blocks;
  WEAVE_CHECK(split_.stages >= 1 && split_.stage >= 0 && split_.stage < split_.stages &&
                  options.layers >= split_.stages,
              "ParallelGPT2Model",
              "expected stage s of S stages, 0 <= s < S <= layers ({}), found stage {} of {}",
              options.layers, split_.stage, split_.stages);
  WEAVE_CHECK(!options.untied_head, "ParallelGPT2Model",
              "an untied head is not split here; hint: GPT-2 ties it to the token embedding");
  const bool first_stage = split_.stage == 0, last_stage = split_.stage == split_.stages - 1;
  // The last stage's head multiplies by the token embedding: in a pipeline it holds a copy of
  // its own under the same name, tied to the first stage's (Megatron-LM's shared embedding).
  if (first_stage || last_stage)
    tokens = register_module("tokens", std::make_shared<VocabParallelEmbedding>(
                                           options.vocab, options.dim, group_, options.generator,
                                           padded_vocab(options.vocab, group_.size())));
  if (first_stage)
    positions = register_module(
        "positions",
        std::make_shared<nn::Embedding>(options.max_positions, options.dim, options.generator));
  const int64_t first = options.layers * split_.stage / split_.stages;
  const int64_t last = options.layers * (split_.stage + 1) / split_.stages;
  auto stack = register_module("blocks", std::make_shared<nn::Sequential>(size_t(first)));
  for (int64_t i = first; i < last; ++i) {
    blocks.push_back(std::make_shared<ParallelTransformerBlock>(
        options.dim, options.heads, group_,
        ParallelTransformerBlockOptions{.tanh_gelu = true,
                                        .generator = options.generator,
                                        .context_group = split_.context_group,
                                        .context_mode = split_.context_mode,
                                        .context_layout = split_.context_layout,
                                        .moe = block_experts(split_, i),
                                        .expert_group = split_.expert_group,
                                        .balance_group = split_.balance_group}));
    stack->push_back(blocks.back());
  }
  if (last_stage)
    norm = register_module("norm", std::make_shared<nn::LayerNorm>(Shape{options.dim}));
  if (split_.stages > 1 && tokens) tie_first_and_last_stage(tokens->weight);
  if (split_.context_group) record_context_reads(*this, *split_.context_group);
}

Tensor ParallelGPT2Model::forward(const Tensor& ids) {
  return run(ids, nullptr, split_.gather_logits);
}

std::vector<std::string> ParallelGPT2Model::shard_units() const {
  std::vector<std::string> names;
  if (positions) names.push_back("positions");
  for (const auto& [child, stack] : named_children())
    if (child == "blocks")
      for (const auto& [name, block] : stack->named_children()) names.push_back("blocks." + name);
  if (norm) names.push_back("norm");
  return names;
}

Tensor ParallelGPT2Model::aux_loss() const {
  Tensor total;
  for (const auto& block : blocks)
    if (Tensor aux = block->aux_loss(); aux.defined()) total = total.defined() ? total + aux : aux;
  return total;
}

std::vector<nn::KVCache> ParallelGPT2Model::make_caches(int64_t max_length) const {
  WEAVE_CHECK(max_length <= options_.max_positions, "ParallelGPT2Model",
              "{} positions exceed the {} the position embedding holds", max_length,
              options_.max_positions);
  return std::vector<nn::KVCache>(blocks.size(), nn::KVCache(max_length));
}

Tensor ParallelGPT2Model::forward_cached(const Tensor& ids, std::vector<nn::KVCache>& caches) {
  WEAVE_CHECK(split_.stages == 1, "ParallelGPT2Model",
              "decoding with caches is not split into pipeline stages; hint: decode with the "
              "whole model (gather it, or load a checkpoint of it)");
  WEAVE_CHECK(!split_.context_group, "ParallelGPT2Model",
              "decoding with caches is not split over a context group; hint: decode with a model "
              "built without one (gather_state_dict)");
  WEAVE_CHECK(caches.size() == blocks.size(), "ParallelGPT2Model",
              "expected a cache per block ({}), found {}; hint: make_caches", blocks.size(),
              caches.size());
  NoGradGuard no_grad;
  return run(ids, &caches, true);
}

// The first stage's token and position embeddings of ids [B, T] sitting after `start`
// positions (this rank's part of each sequence under context parallelism), [B, T, dim].
Tensor ParallelGPT2Model::embed(const Tensor& ids, int64_t start) {
  WEAVE_CHECK(ids.defined() && ids.dim() == 2, "ParallelGPT2Model",
              "expected tokens [B, T], found {}", ids.defined() ? ids.shape() : Shape{});
  const int parts = split_.context_group ? split_.context_group->size() : 1;
  const int64_t length = ids.size(1) * parts;  // the whole sequence's
  WEAVE_CHECK(start + length <= options_.max_positions, "ParallelGPT2Model",
              "positions up to {} exceed the {} the position embedding holds", start + length,
              options_.max_positions);
  Tensor where = position_ids(start, length, ids.device());
  if (parts > 1) where = shard_sequence(where, 0, *split_.context_group, split_.context_layout);
  return (*tokens)(ids) + (*positions)(where);
}

// The blocks run sequence first ([T, B, dim]), as ParallelTransformerBlock takes them; between
// pipeline stages hidden states travel batch first, [B, T, dim].
Tensor ParallelGPT2Model::run(const Tensor& input, std::vector<nn::KVCache>* caches, bool gather) {
  Tensor x;
  if (positions) {
    x = embed(input, caches ? caches->front().length() : 0);
  } else {
    WEAVE_CHECK(
        input.defined() && input.dim() == 3 && input.size(-1) == options_.dim, "ParallelGPT2Model",
        "stage {} of {} expected the previous stage's hidden states [B, T, {}], found {}",
        split_.stage, split_.stages, options_.dim, input.defined() ? input.shape() : Shape{});
    x = input;
  }
  x = x.transpose(0, 1);
  for (size_t i = 0; i < blocks.size(); ++i)
    x = caches ? blocks[i]->call(
                     nn::Inputs(x),
                     [&](const nn::Inputs& in) { return blocks[i]->forward(in.x, (*caches)[i]); })
        : recompute_blocks_ ? nn::checkpointed(*blocks[i], nn::Inputs(x))
                            : (*blocks[i])(x);
  x = x.transpose(0, 1);
  if (!norm) {  // a stage before the last (the pipeline sends it contiguous)
    // Its experts' balancing losses join the objective through the activation (the last
    // stage's loss can add only its own blocks').
    const Tensor aux = is_training() && !caches ? aux_loss() : Tensor();
    return aux.defined() ? attach_loss(x, aux) : x;
  }
  x = (*norm)(x);
  // The tied head: this rank's vocabulary rows; the input's gradient sums over the group.
  Tensor logits = linear(dist::functional::copy_to_group(x, group_), tokens->weight);
  return vocab_parallel_logits(logits, options_.vocab, group_, gather);
}

}  // namespace weave::parallel

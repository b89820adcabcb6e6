#include "weave/parallel/model_parallel/parallel_gpt2.h"

#include "weave/autograd/grad_mode.h"
#include "weave/distributed/functional.h"

namespace weave::parallel {

ParallelGPT2Model::ParallelGPT2Model(nn::GPT2ModelOptions options, dist::Group group,
                                     ParallelLMOptions split)
    : nn::CausalLM("ParallelGPT2Model"),
      options_(options),
      group_(std::move(group)),
      split_(std::move(split)) {
  WEAVE_CHECK(split_.stages == 1, "ParallelGPT2Model",
              "GPT-2's head is tied to its token embedding, which pipeline stages would hold on "
              "the first stage and the last; hint: split GPT-2 with tensor, context and data "
              "parallelism, or pipeline a Llama-family model");
  WEAVE_CHECK(!options.untied_head, "ParallelGPT2Model",
              "an untied head is not split here; hint: GPT-2 ties it to the token embedding");
  tokens = register_module("tokens", std::make_shared<VocabParallelEmbedding>(
                                         options.vocab, options.dim, group_, options.generator,
                                         padded_vocab(options.vocab, group_.size())));
  positions = register_module(
      "positions",
      std::make_shared<nn::Embedding>(options.max_positions, options.dim, options.generator));
  auto stack = register_module("blocks", std::make_shared<nn::Sequential>());
  for (int64_t i = 0; i < options.layers; ++i) {
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
  norm = register_module("norm", std::make_shared<nn::LayerNorm>(Shape{options.dim}));
}

Tensor ParallelGPT2Model::forward(const Tensor& ids) {
  return run(ids, nullptr, split_.gather_logits);
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
  WEAVE_CHECK(!split_.context_group, "ParallelGPT2Model",
              "decoding with caches is not split over a context group; hint: decode with a model "
              "built without one (gather_state_dict)");
  WEAVE_CHECK(caches.size() == blocks.size(), "ParallelGPT2Model",
              "expected a cache per block ({}), found {}; hint: make_caches", blocks.size(),
              caches.size());
  NoGradGuard no_grad;
  return run(ids, &caches, true);
}

// The blocks run sequence first ([T, B, dim]), as ParallelTransformerBlock takes them.
Tensor ParallelGPT2Model::run(const Tensor& ids, std::vector<nn::KVCache>* caches, bool gather) {
  WEAVE_CHECK(ids.defined() && ids.dim() == 2, "ParallelGPT2Model",
              "expected tokens [B, T], found {}", ids.defined() ? ids.shape() : Shape{});
  const int64_t start = caches ? caches->front().length() : 0;
  const int parts = split_.context_group ? split_.context_group->size() : 1;
  const int64_t length = ids.size(1) * parts;  // the whole sequence's
  WEAVE_CHECK(start + length <= options_.max_positions, "ParallelGPT2Model",
              "positions up to {} exceed the {} the position embedding holds", start + length,
              options_.max_positions);
  Tensor where =
      arange(double(start), double(start + length), 1, {.dtype = kInt64, .device = ids.device()});
  if (parts > 1) where = shard_sequence(where, 0, *split_.context_group, split_.context_layout);
  Tensor x = ((*tokens)(ids) + (*positions)(where)).transpose(0, 1);
  for (size_t i = 0; i < blocks.size(); ++i)
    x = caches ? blocks[i]->forward(x, (*caches)[i]) : (*blocks[i])(x);
  x = (*norm)(x.transpose(0, 1));
  // The tied head: this rank's vocabulary rows; the input's gradient sums over the group.
  Tensor logits = linear(dist::functional::copy_to_group(x, group_), tokens->weight);
  return vocab_parallel_logits(logits, options_.vocab, group_, gather);
}

}  // namespace weave::parallel

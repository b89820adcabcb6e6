#include "weave/nn/gpt2.h"

#include "weave/autograd/grad_mode.h"

namespace weave::nn {

GPT2Model::GPT2Model(GPT2ModelOptions options) : CausalLM("GPT2Model"), options_(options) {
  recompute_blocks_ = options.recompute_blocks;
  WEAVE_CHECK(
      options.vocab > 0 && options.dim > 0 && options.layers > 0 && options.max_positions > 0,
      "GPT2Model",
      "vocab, dim, layers and max_positions must be positive, found {}, {}, "
      "{} and {}",
      options.vocab, options.dim, options.layers, options.max_positions);
  tokens = register_module(
      "tokens", std::make_shared<Embedding>(options.vocab, options.dim, options.generator));
  positions = register_module(
      "positions",
      std::make_shared<Embedding>(options.max_positions, options.dim, options.generator));
  auto stack = register_module("blocks", std::make_shared<Sequential>());
  for (int64_t i = 0; i < options.layers; ++i) {
    blocks.push_back(std::make_shared<TransformerBlock>(
        options.dim, options.heads,
        TransformerBlockOptions{.tanh_gelu = true, .generator = options.generator}));
    stack->push_back(blocks.back());
  }
  norm = register_module("norm", std::make_shared<LayerNorm>(Shape{options.dim}));
  if (options.untied_head)
    head = register_module(
        "head", std::make_shared<Linear>(options.dim, options.vocab, false, options.generator));
}

Tensor GPT2Model::forward(const Tensor& ids) {
  return run(ids, nullptr);
}

std::vector<KVCache> GPT2Model::make_caches(int64_t max_length) const {
  WEAVE_CHECK(max_length <= options_.max_positions, "GPT2Model",
              "{} positions exceed the {} the position embedding holds", max_length,
              options_.max_positions);
  return std::vector<KVCache>(blocks.size(), KVCache(max_length));
}

std::vector<std::string> GPT2Model::shard_units() const {
  std::vector<std::string> names{"positions", "norm"};
  if (head) names.push_back("head");
  for (size_t i = 0; i < blocks.size(); ++i) names.push_back("blocks." + std::to_string(i));
  return names;
}

Tensor GPT2Model::forward_cached(const Tensor& ids, std::vector<KVCache>& caches) {
  WEAVE_CHECK(caches.size() == blocks.size(), "GPT2Model",
              "expected a cache per block ({}), found {}; hint: make_caches", blocks.size(),
              caches.size());
  NoGradGuard no_grad;
  return run(ids, &caches);
}

Tensor GPT2Model::run(const Tensor& ids, std::vector<KVCache>* caches) {
  WEAVE_CHECK(ids.defined() && ids.dim() == 2, "GPT2Model", "expected tokens [B, T], found {}",
              ids.defined() ? ids.shape() : Shape{});
  const int64_t start = caches ? caches->front().length() : 0;
  WEAVE_CHECK(start + ids.size(1) <= options_.max_positions, "GPT2Model",
              "positions up to {} exceed the {} the position embedding holds", start + ids.size(1),
              options_.max_positions);
  const Tensor where = position_ids(start, ids.size(1), ids.device());
  Tensor x = (*tokens)(ids) + (*positions)(where);
  for (size_t i = 0; i < blocks.size(); ++i)
    x = caches ? blocks[i]->call(
                     Inputs(x),
                     [&](const Inputs& in) { return blocks[i]->forward(in.x, (*caches)[i]); })
        : recompute_blocks_ ? checkpointed(*blocks[i], Inputs(x))
                            : (*blocks[i])(x);
  x = (*norm)(x);
  return head ? (*head)(x) : linear(x, tokens->weight);
}

}  // namespace weave::nn

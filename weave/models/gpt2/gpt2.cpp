// GPT-2, whole or split: nn/ layers built with the split's leaves, batch first throughout
// (sequence parallelism cuts dim 1).
#include "weave/models/gpt2/gpt2.h"

#include "weave/autograd/grad_mode.h"
#include "weave/distributed/functional.h"
#include "weave/parallel/core/placement.h"
#include "weave/parallel/model_parallel/context_parallel.h"
#include "weave/parallel/model_parallel/tensor_parallel.h"

namespace weave::models {

namespace {

constexpr const char* kGPT2 = "GPT2";

}  // namespace

GPT2::GPT2(GPT2Options options, ModelSplit split)
    : nn::CausalLM(kGPT2), options_(options), split_(std::move(split)) {
  WEAVE_CHECK(
      options.vocab > 0 && options.dim > 0 && options.layers > 0 && options.max_positions > 0,
      kGPT2, "vocab, dim, layers and max_positions must be positive, found {}, {}, {} and {}",
      options.vocab, options.dim, options.layers, options.max_positions);
  split_.check(kGPT2, options.layers, options.moe.has_value());
  WEAVE_CHECK(options.untied_head || !options.head_bias, kGPT2,
              "head_bias needs untied_head (the tied head is the token embedding's table)");
  // The last stage's head multiplies by the token embedding: in a pipeline it holds a copy of
  // its own under the same name, tied to the first stage's (Megatron-LM's shared embedding).
  const detail::TokenTable table = detail::stage_token_table(
      options.vocab, options.dim, split_, !options.untied_head, options.generator);
  if (table.module) {
    tokens = register_module("tokens", table.module);
    token_weight_ = table.weight;
  }
  if (split_.first_stage())
    positions = register_module(
        "positions",
        std::make_shared<nn::Embedding>(options.max_positions, options.dim, options.generator));
  add_blocks();
  if (split_.last_stage()) add_head();
  if (split_.context_group) parallel::record_context_reads(*this, *split_.context_group);
}

void GPT2::add_blocks() {
  const auto [first, last] = split_.stage_blocks(options_.layers);
  blocks = register_module("blocks", std::make_shared<nn::Sequential>(size_t(first)));
  const nn::Leaves leaves = split_.leaves();
  for (int64_t i = first; i < last; ++i)
    blocks->push_back(std::make_shared<nn::TransformerBlock>(
        options_.dim, options_.heads,
        nn::TransformerBlockOptions{.tanh_gelu = options_.tanh_gelu,
                                    .generator = options_.generator,
                                    .moe = detail::block_experts(options_.moe, i)},
        leaves));
}

void GPT2::add_head() {
  const Shape dim{options_.dim};
  norm = register_module("norm", split_.leaves().linear().layer_norm(dim, 1e-5));
  if (!options_.untied_head) return;
  head =
      register_module("head", detail::output_head(options_.dim, options_.vocab, options_.head_bias,
                                                  split_, options_.generator));
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
  if (tokens && options_.untied_head) names.push_back("tokens");
  if (positions) names.push_back("positions");
  for (const auto& [name, block] : blocks->named_children()) names.push_back("blocks." + name);
  if (norm) names.push_back("norm");
  if (head) names.push_back("head");
  return names;
}

Tensor GPT2::aux_loss() const {
  return detail::sum_aux_losses(*blocks);
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

// The tensor-parallel blocks run sequence first ([T, B, dim]), under sequence parallelism on
// this rank's part of the sequence; between pipeline stages hidden states travel batch first,
// [B, T, dim] (that part: [B, T / n, dim]).
Tensor GPT2::run(const Tensor& input, std::vector<nn::KVCache>* caches, bool gather) {
  if (!positions) detail::check_stage_input(kGPT2, split_, input, options_.dim);
  if (positions && !caches && split_.context_group)  // parts cut as the split reads them
    parallel::check_sequence_part(input, Tensor(), Tensor(), *split_.context(), kGPT2);
  Tensor x = positions ? embed(input, caches ? caches->front().length() : 0) : input;
  if (positions && split_.sequence_parallel)
    x = dist::functional::scatter_to_group(x.contiguous(), 1, *split_.tensor);
  if (caches) {
    for (size_t i = 0; i < blocks->size(); ++i) {  // between its hooks: FSDP gathers the block
      auto& block = static_cast<nn::CachedModule&>((*blocks)[i]);
      x = block.call(nn::Inputs(x),
                     [&](const nn::Inputs& in) { return block.forward(in, (*caches)[i]); });
    }
  } else {
    x = run_blocks(*blocks, nn::Inputs(x));
  }
  if (!norm) return x;
  return logits((*norm)(x), gather);
}

Tensor GPT2::logits(const Tensor& hidden, bool gather) {
  return detail::head_logits(hidden, head.get(), head ? Tensor() : token_weight(), options_.vocab,
                             split_, gather);
}

}  // namespace weave::models

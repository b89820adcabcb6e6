#include "weave/models/model_split.h"

#include "weave/distributed/functional.h"
#include "weave/ops/ops.h"
#include "weave/parallel/core/placement.h"
#include "weave/parallel/model_parallel/experts.h"
#include "weave/parallel/model_parallel/tensor_parallel.h"

namespace weave::models {

ModelSplit ModelSplit::from_mesh(const parallel::ProcessMesh& mesh, ModelSplit base) {
  const parallel::MeshShape& shape = mesh.shape();
  base.tensor = shape.tensor > 1 ? std::optional(mesh.tensor()) : std::nullopt;
  base.context_group = shape.context > 1 ? std::optional(mesh.context()) : std::nullopt;
  base.stage = mesh.pipeline_rank();
  base.stages = shape.pipeline;
  base.expert_group = shape.expert > 1 ? std::optional(mesh.expert()) : std::nullopt;
  const dist::Group balance = mesh.data_and_context();
  base.balance_group = balance.size() > 1 ? std::optional(balance) : std::nullopt;
  base.vocabulary = std::nullopt;
  if (base.shard_vocabulary && mesh.shard().size() > 1)
    base.vocabulary = parallel::VocabularyGroups{.pieces = mesh.vocabulary(),
                                                 .tensor = base.tensor,
                                                 .batches = mesh.shard(),
                                                 .sequence_parallel = base.sequence_parallel};
  return base;
}

ModelSplit ModelSplit::from_mesh(const parallel::ProcessMesh& mesh) {
  return from_mesh(mesh, ModelSplit{});
}

std::optional<parallel::ContextSplit> ModelSplit::context() const {
  if (!context_group) return std::nullopt;
  return parallel::ContextSplit{*context_group, context_mode, context_layout};
}

nn::Leaves ModelSplit::leaves() const {
  nn::Leaves leaves;
  if (tensor)
    leaves.linears = parallel::tensor_parallel(*tensor, {.sequence_parallel = sequence_parallel});
  if (context_group) leaves.attention = parallel::context_parallel(*context());
  if (expert_group || balance_group)
    leaves.experts = parallel::spread_experts(expert_group, balance_group);
  return leaves;
}

bool ModelSplit::whole() const {
  return !tensor && stages == 1 && !(expert_group && expert_group->size() > 1) && !vocabulary;
}

std::optional<parallel::VocabularyGroups> ModelSplit::vocabulary_groups() const {
  if (vocabulary) return vocabulary;
  if (tensor) return parallel::VocabularyGroups::over_tensor(*tensor, sequence_parallel);
  return std::nullopt;
}

std::pair<int64_t, int64_t> ModelSplit::stage_blocks(int64_t layers) const {
  return {layers * stage / stages, layers * (stage + 1) / stages};
}

void ModelSplit::check(const char* model, int64_t layers, bool with_experts) const {
  WEAVE_CHECK(stages >= 1 && stage >= 0 && stage < stages && layers >= stages, model,
              "expected stage s of S stages, 0 <= s < S <= layers ({}), found stage {} of {}",
              layers, stage, stages);
  WEAVE_CHECK(!sequence_parallel || (tensor && !context_group && !with_experts), model,
              "sequence parallelism splits the sequence over a tensor group, and needs whole "
              "sequences for experts and context parallelism; found a tensor group: {}, a "
              "context group: {}, experts: {}; hint: one of them at a time",
              tensor.has_value(), context_group.has_value(), with_experts);
  if (!vocabulary) return;
  vocabulary->check(model);
  const int64_t tensor_size = tensor ? tensor->size() : 1;
  WEAVE_CHECK(
      vocabulary->batches && (vocabulary->tensor ? vocabulary->tensor->size() : 1) == tensor_size &&
          (!tensor || (vocabulary->tensor && vocabulary->tensor->rank() == tensor->rank())) &&
          vocabulary->sequence_parallel == sequence_parallel,
      model,
      "the vocabulary's groups must be the split's tensor group (size {}, sequence "
      "parallel {}) and a group of batch ranks; found batches {}, a tensor group of {} "
      "(sequence parallel {}); hint: ModelSplit::from_mesh sets them",
      tensor_size, sequence_parallel, vocabulary->batches.has_value(),
      vocabulary->tensor ? vocabulary->tensor->size() : 1, vocabulary->sequence_parallel);
}

nn::Inputs ModelSplit::local_inputs(const nn::Inputs& inputs) const {
  if (!context_group) return inputs;
  return nn::Inputs(local_sequence(inputs.x), local_sequence(inputs.positions),
                    local_sequence(inputs.document_ids));
}

Tensor ModelSplit::local_sequence(const Tensor& targets) const {
  if (!context_group || !targets.defined()) return targets;
  return parallel::shard_sequence(targets, 1, *context_group, context_layout);
}

Tensor ModelSplit::cross_entropy(const Tensor& logits, const Tensor& targets) const {
  const Tensor flat = logits.reshape({-1, logits.size(-1)});
  const Tensor target = targets.reshape({-1});
  if (const auto groups = vocabulary_groups(); groups && !gather_logits)
    return parallel::vocab_parallel_cross_entropy(flat, target, *groups);
  return weave::cross_entropy(flat, target);
}

void ModelSplit::check_decoding(const char* model, size_t caches, size_t blocks) const {
  WEAVE_CHECK(stages == 1, model,
              "decoding with caches is not split into pipeline stages; hint: decode with the "
              "whole model (gather it, or load a checkpoint of it)");
  WEAVE_CHECK(!context_group, model,
              "decoding with caches is not split over a context group; hint: decode with a model "
              "built without one (gather_state_dict)");
  WEAVE_CHECK(!sequence_parallel, model,
              "decoding with caches is not split along the sequence (one position at a time); "
              "hint: decode with a model built without sequence_parallel (the same parameters)");
  WEAVE_CHECK(caches == blocks, model,
              "expected a cache per block ({}), found {}; hint: make_caches", blocks, caches);
}

namespace detail {

TokenTable token_table(int64_t vocab, int64_t dim, const ModelSplit& split, Generator* generator) {
  if (const auto groups = split.vocabulary_groups()) {
    auto table = std::make_shared<parallel::VocabParallelEmbedding>(vocab, dim, *groups, generator,
                                                                    groups->padded(vocab));
    return {table, &table->weight};
  }
  auto table = std::make_shared<nn::Embedding>(vocab, dim, generator);
  return {table, &table->weight};
}

TokenTable stage_token_table(int64_t vocab, int64_t dim, const ModelSplit& split, bool tied_head,
                             Generator* generator) {
  if (!split.first_stage() && !(split.last_stage() && tied_head)) return {};
  TokenTable table = token_table(vocab, dim, split, generator);
  if (split.stages > 1 && tied_head) parallel::tie_first_and_last_stage(*table.weight);
  return table;
}

Tensor soft_capped(const Tensor& logits, double cap) {
  return cap > 0 ? tanh(logits * (1.0 / cap)) * cap : logits;
}

std::shared_ptr<nn::Module> output_head(int64_t dim, int64_t vocab, bool bias,
                                        const ModelSplit& split, Generator* generator) {
  if (const auto groups = split.vocabulary_groups())
    return std::make_shared<parallel::VocabParallelHead>(dim, vocab, *groups, bias, generator,
                                                         groups->padded(vocab));
  return std::make_shared<nn::Linear>(dim, vocab, bias, generator);
}

Tensor head_logits(const Tensor& hidden, nn::Module* head, const Tensor& table, int64_t vocab,
                   const ModelSplit& split, bool gather, double softcap) {
  const auto groups = split.vocabulary_groups();
  const Tensor local = head     ? (*head)(hidden)
                       : groups ? linear(parallel::vocabulary_rows(hidden, *groups), table)
                                : linear(hidden, table);
  if (!groups) return soft_capped(local, softcap);
  return parallel::vocab_parallel_logits(soft_capped(local, softcap), vocab, *groups, gather);
}

Tensor sum_aux_losses(const nn::Module& module) {
  Tensor total;
  if (const auto* experts = dynamic_cast<const nn::MoE*>(&module)) total = experts->aux_loss();
  for (const auto& [name, child] : module.named_children())
    if (Tensor aux = sum_aux_losses(*child); aux.defined())
      total = total.defined() ? total + aux : aux;
  return total;
}

std::optional<nn::MoEOptions> block_experts(const std::optional<nn::MoEOptions>& experts,
                                            int64_t index) {
  if (!experts) return std::nullopt;
  nn::MoEOptions options = *experts;
  options.seed += uint64_t(index);
  return options;
}

void check_stage_input(const char* model, const ModelSplit& split, const Tensor& hidden,
                       int64_t dim) {
  WEAVE_CHECK(hidden.defined() && hidden.dim() == 3 && hidden.size(-1) == dim, model,
              "stage {} of {} expected the previous stage's hidden states [B, T, {}], found {}",
              split.stage, split.stages, dim, hidden.defined() ? hidden.shape() : Shape{});
}

}  // namespace detail

}  // namespace weave::models

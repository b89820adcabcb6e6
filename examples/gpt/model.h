#pragma once
// examples/gpt's model: the library's models::GPT2 (as the original GPT: the exact GELU, a head
// of its own with a bias) or models::Llama, whole or split as the mesh says (one
// models::ModelSplit), and its training objective. Every layout holds the slices of one whole
// model under its parameter names, so one initialization by name starts them all equal.
#include <weave/weave.h>

#include "flags.h"

#include <memory>
#include <optional>
#include <string>

namespace gpt {

/// Every block's mixture of experts under --experts (block i's seeded --seed + i): --experts of
/// them, each a 4 dim / K MLP (a token costs the dense MLP's compute), top --top-k; balanced
/// by the auxiliary loss, or with --expert-bias by a selection bias instead.
inline std::optional<nn::MoEOptions> experts_of(const Flags& f) {
  if (f.experts == 0) return std::nullopt;
  return nn::MoEOptions{.hidden = f.dim,
                        .ffn = 4 * f.dim / f.top_k,
                        .router = {.experts = f.experts,
                                   .top_k = f.top_k,
                                   .aux_loss_coef = f.expert_bias > 0 ? 0.0 : 0.01,
                                   .bias_update_rate = f.expert_bias},
                        .seed = f.seed};
}

/// This rank's split of the model: its tensor group, context group and pipeline stage, and the
/// experts' groups, as the mesh says. Sequence parallelism splits what experts and context
/// parallelism need whole, and Llama's layers take whole sequences.
inline models::ModelSplit split_of(const Flags& f, const parallel::ProcessMesh& mesh) {
  const parallel::MeshShape& shape = mesh.shape();
  return models::ModelSplit::from_mesh(
      mesh, {.sequence_parallel = shape.tensor > 1 && f.sequence_parallel && f.experts == 0 &&
                                  shape.context == 1 && f.arch == "gpt",
             .context_mode = f.cp_mode == "ring" ? parallel::ContextParallelMode::Ring
                                                 : parallel::ContextParallelMode::AllToAll,
             // ZeRO-1 and the reproducible sums average whole parameters
             .shard_vocabulary = f.shard_vocabulary && !f.reproducible && f.strategy != "zero"});
}

/// The model of the flags with `split` (its parameters drawn as the caller's init says).
inline std::shared_ptr<nn::CausalLM> make_model(const Flags& f, int64_t vocab,
                                                models::ModelSplit split) {
  std::shared_ptr<nn::CausalLM> model;
  if (f.arch == "llama")
    model = std::make_shared<models::Llama>(models::LlamaOptions{.vocab = vocab,
                                                                 .dim = f.dim,
                                                                 .layers = f.layers,
                                                                 .block = {.heads = f.heads,
                                                                           .kv_heads = f.kv_heads,
                                                                           .hidden = f.ffn,
                                                                           .moe = experts_of(f)}},
                                            std::move(split));
  else
    model = std::make_shared<models::GPT2>(models::GPT2Options{.vocab = vocab,
                                                               .dim = f.dim,
                                                               .layers = f.layers,
                                                               .heads = f.heads,
                                                               .max_positions = f.context,
                                                               .tanh_gelu = false,
                                                               .untied_head = true,
                                                               .head_bias = true,
                                                               .moe = experts_of(f)},
                                           std::move(split));
  model->set_recompute_blocks(f.checkpoint_activations);
  return model;
}

/// The data-parallel wrapping of the flags' model: DDP, FSDP (HSDP under --replicate) or, on one
/// replica or under zero (whose optimizer averages), the model itself; FSDP keeps a pipeline's
/// units gathered across its micro-batches (torchtitan's choice).
inline parallel::DataParallelOptions wrapping(const Flags& f, const parallel::ProcessMesh& mesh) {
  return {.shard = f.strategy == "fsdp",
          .fsdp = {.reshard_after_forward = mesh.shape().pipeline == 1,
                   .param_dtype = f.param_dtype,
                   .reduce_dtype = kFloat32,
                   .output_dtype = kFloat32,
                   .reproducible = f.reproducible},
          .ddp = {.reproducible = f.reproducible},
          .optimizer_averages = f.strategy == "zero"};  // ZeRO-1 averages in its step
}

/// GPT-2's initialization: weights N(0, 0.02), biases 0, norms 1 (their own ones). Under
/// nn::DeferredInit these set recipes: each parameter is drawn by its name from the seed.
inline void initialize(nn::Module& model) {
  for (auto& [name, p] : model.named_parameters()) {
    if (name.ends_with(".bias"))
      nn::init::zeros_(p);
    else if (name.find("norm") == std::string::npos)
      nn::init::normal_(p, 0, 0.02);
  }
}

/// The training objective of `model`'s logits against targets of this rank's positions: the
/// mean cross-entropy (over the tensor group's vocabulary slices when split). The experts'
/// balancing losses need no adding: each block's travels with its output into backward.
inline Tensor objective(const models::ModelSplit& split, const Tensor& logits,
                        const Tensor& targets) {
  return split.cross_entropy(logits, targets);
}

}  // namespace gpt

#pragma once
// Low-rank adapters (nn/lora.h) as Hugging Face PEFT files: adapter_config.json (peft_type LORA,
// r, lora_alpha, lora_dropout, use_rslora, target_modules, base_model_name_or_path) and
// adapter_model.safetensors, whose tensors PEFT names by the base model's modules
// ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" [r, in], "...lora_B.weight"
// [out, r]). weave's adapters on a stacked projection (k and v of kv, gate and up of gate_up) are
// PEFT's on k_proj, v_proj, gate_proj and up_proj; GPT-2's c_attn adapter's B rows are reordered
// as its weight's are (q, k, v side by side in the file, each head's together in weave).
//
//   auto model = models::from_pretrained("llama/");
//   const auto config = data::hf::read_config("llama/");
//   nn::LoRAOptions lora{.rank = 8, .alpha = 16,
//                        .targets = models::peft_targets(config, {"q_proj", "v_proj"})};
//   nn::add_lora(*model, lora);
//   ... train ...
//   models::save_adapters(*model, config, lora, "adapter/", {.base_model = "llama/"});
//
//   auto fresh = models::from_pretrained("llama/", split);   // any layout
//   models::load_adapters(*fresh, config, "adapter/");        // add_lora as the file says, then
//                                                             // this rank's pieces of its values
// Saved from any layout (tensor-parallel pieces, pipeline stages, FSDP's sharded_module()), put
// together at rank 0 one tensor at a time; loaded into a split model before a data-parallel
// wrapper wraps it.
#include <optional>
#include <string>
#include <vector>

#include "weave/data/hf/hf_checkpoint.h"
#include "weave/distributed/distributed.h"
#include "weave/nn/lora.h"

namespace weave::models {

/// PEFT's target_modules (Hugging Face module names, short as "q_proj" or full as
/// "model.layers.0.self_attn.q_proj"; or "all-linear") as weave's targets for the config's
/// architecture: the paths of the projections they name. Raises, naming it, for a module that
/// names no projection of the architecture (a mixture of experts' experts take no adapters).
std::vector<std::string> peft_targets(const data::hf::ModelConfig& config,
                                      const std::vector<std::string>& modules);

struct AdapterSaveOptions {
  /// adapter_config.json's base_model_name_or_path.
  std::string base_model{};
};

/// Writes model's adapters (added with `options`) to dir as PEFT writes them. Whole on one
/// process; under dist::init() collective over `group` (the world when unset), which must take in
/// every rank that holds a part of an adapter: each is put together at group rank 0, which writes
/// (each file atomically). Raises on every rank when the model has no adapters or one fails.
void save_adapters(nn::Module& model, const data::hf::ModelConfig& config,
                   const nn::LoRAOptions& options, const std::string& dir,
                   const AdapterSaveOptions& save = {},
                   const std::optional<dist::Group>& group = {});

/// adapter_config.json in dir as the options of add_lora, its target_modules as peft_targets
/// gives them. Raises, naming the file and the field, for a peft_type other than LORA, bias other
/// than "none", modules_to_save, a regular expression for target_modules, or a missing field.
nn::LoRAOptions read_adapter_config(const std::string& dir, const data::hf::ModelConfig& config);

/// Adds dir's adapters to `model` (whole or split, not yet wrapped for data parallelism: each
/// rank takes its pieces): add_lora with read_adapter_config's options, then the values. Raises,
/// naming the tensor, for one the file lacks, one it holds that no adapter of the model takes,
/// and a shape that is not the adapter's ([r, in], [out, r]); then the model is unchanged.
/// Returns the options.
nn::LoRAOptions load_adapters(nn::Module& model, const data::hf::ModelConfig& config,
                              const std::string& dir);

}  // namespace weave::models

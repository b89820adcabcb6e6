#pragma once
// What weave takes from a Hugging Face config.json, and the reading and writing of that file: the
// one value the models floor builds a model from (models::make_model, llama_options,
// gpt2_options) and exports with, apart from the weights' readers and writers
// (hf_checkpoint.h) and the tokenizer.
//
//   const data::hf::ModelConfig config = data::hf::read_config("llama/");
//   auto model = models::make_model(config);
#include <optional>
#include <string>
#include <vector>

#include "weave/ops/ops.h"

namespace weave::data::hf {

/// What weave takes from config.json (everything else is kept and written back on export).
struct ModelConfig {
  /// The architecture: "llama" (Llama, Mistral, Mixtral, Qwen 2, Qwen 3 and Qwen 3 MoE
  /// checkpoints), "gemma" (Gemma 2
  /// and Gemma 3's text model, built as models::Llama too) or "gpt2".
  std::string architecture = "llama";
  int64_t vocab = 0, dim = 0, layers = 0, heads = 0;
  int64_t kv_heads = 0;       // Llama: num_key_value_heads (GPT-2: heads)
  int64_t hidden = 0;         // the MLP's width
  int64_t max_positions = 0;  // GPT-2: n_positions
  double norm_eps = 1e-5;
  double rope_theta = 10000;
  std::optional<Llama3RopeScaling> rope_scaling{};
  bool tie_embeddings = false;
  bool qkv_bias = false;  // Qwen 2 (model_type qwen2): q, k and v projections with biases
  bool qk_norm = false;   // Qwen 3 (model_type qwen3): per-head RMSNorm of q and k
  int64_t head_dim = 0;   // each attention head's size (head_dim; 0: dim / heads)
  /// config.json's model_type ("llama", "mistral", "qwen2", "qwen3"); "" when built here (export
  /// then names the architecture by its features).
  std::string model_type;
  /// The attention's sliding window (Mistral's sliding_window, Qwen's with use_sliding_window);
  /// 0: none.
  int64_t sliding_window = 0;
  /// Which layers attend through the window (layer_types, or Qwen's max_window_layers); empty:
  /// every layer.
  std::vector<bool> windowed_layers{};
  // Mixtral's and Qwen 3 MoE's experts (0: a dense MLP in every block):
  int64_t experts = 0, experts_per_token = 0;
  int64_t expert_hidden = 0;         // each expert's width (Qwen: moe_intermediate_size)
  bool norm_topk_prob = true;        // the chosen experts' gates renormalized
  int64_t shared_expert_hidden = 0;  // Qwen 2 MoE's gated shared expert's width (0: none)
  double router_aux_loss_coef = 0;   // the load-balancing loss's weight in training
  // Gemma's (model_type gemma2, gemma3_text):
  double attention_softcap = 0;      // attn_logit_softcapping (0: none)
  double logit_softcap = 0;          // final_logit_softcapping (0: none)
  double query_pre_attn_scalar = 0;  // the attention scale is its -1/2 power (0: head_dim's)
  double rope_local_theta = 0;       // Gemma 3: rope_local_base_freq of windowed layers (0: none)
  double rope_linear_factor = 1;     // rope_scaling of type linear (Gemma 3's global layers)
  DType dtype = kFloat32;            // torch_dtype: the dtype export writes
  std::string json;                  // the file's text, "" when built here
};

/// Reads dir/config.json. Raises for an unknown model_type and for settings weave does not
/// implement (biases in Llama's projections, rope scalings other than Llama 3's, other
/// activations), naming them.
ModelConfig read_config(const std::string& dir);
/// config.json for `config` (its json's other fields kept).
std::string config_json(const ModelConfig& config);

}  // namespace weave::data::hf

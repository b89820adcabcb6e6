#pragma once
// The architectures of weave/models (internal): each folder's Hugging Face description and how
// to build its model, listed once in architectures.cpp. data/hf reads the descriptions
// (data::hf::architectures()) and models::make_model builds from the same list.
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "weave/data/hf/hf_architecture.h"
#include "weave/models/llama/llama.h"
#include "weave/models/model_split.h"
#include "weave/nn/generation.h"

namespace weave::models::detail {

/// Llama, Mistral, Qwen 2 and Qwen 3 (models/llama/llama_hf.cpp).
data::hf::ArchitectureSpec llama_architecture();
/// Gemma 2 and Gemma 3's text model (models/llama/gemma_hf.cpp), built as models::Llama.
data::hf::ArchitectureSpec gemma_architecture();
/// The checkpoint names of a Llama-class model's parameters (Gemma's four norms a block where
/// config.architecture is "gemma"), and the tensors its files may hold unread.
std::vector<data::hf::detail::Mapping> llama_mappings(const data::hf::ModelConfig& config);
bool llama_ignorable(const std::string& tensor, const data::hf::ModelConfig& config);
/// config.json's sizes every Llama-class model names alike (vocab_size, hidden_size,
/// num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size,
/// max_position_embeddings, rms_norm_eps), and its layer_types as which layers slide (none when
/// absent; raises, naming path, for an entry neither sliding_attention nor full_attention).
void read_llama_sizes(const nlohmann::json& file, const std::string& path,
                      data::hf::ModelConfig& config);
std::optional<std::vector<bool>> read_layer_types(const nlohmann::json& file,
                                                  const std::string& path, int64_t layers);
/// Mixtral's and Qwen 3 MoE's experts (models/llama/moe_hf.cpp): whether a model_type has them;
/// config.json's expert fields into config (raising, naming path and field, for what weave does
/// not implement) and back; block `weave` (hf)'s router and expert tensors; the blocks' MoE
/// options of a config, and a config's fields of those options.
bool has_experts(const std::string& model_type);
void read_experts(const nlohmann::json& file, const std::string& path,
                  data::hf::ModelConfig& config);
void write_experts(const data::hf::ModelConfig& config, nlohmann::json& file);
void add_expert_mappings(const data::hf::ModelConfig& config, const std::string& weave,
                         const std::string& hf, std::vector<data::hf::detail::Mapping>& mappings);
std::optional<nn::MoEOptions> experts_of(const data::hf::ModelConfig& config);
void set_experts(const std::optional<nn::MoEOptions>& moe, data::hf::ModelConfig& config);
/// llama_options and model_config for Gemma (models/llama/gemma_hf.cpp).
LlamaOptions gemma_options(const data::hf::ModelConfig& config, Generator* generator);
data::hf::ModelConfig gemma_config(const LlamaOptions& options, DType dtype);
/// GPT-2 (models/gpt2/gpt2_hf.cpp).
data::hf::ArchitectureSpec gpt2_architecture();

struct Architecture {
  data::hf::ArchitectureSpec hf;
  /// The model of a configuration of this architecture, split as `split` says.
  std::function<std::shared_ptr<nn::CausalLM>(const data::hf::ModelConfig&, const ModelSplit&,
                                              Generator*)>
      make;
};

/// Every architecture, in the order data/hf lists them.
const std::vector<Architecture>& model_architectures();

}  // namespace weave::models::detail

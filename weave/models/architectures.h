#pragma once
// The architectures of weave/models (internal): each folder's Hugging Face description and how
// to build its model, listed once in architectures.cpp. data/hf reads the descriptions
// (data::hf::architectures()) and models::make_model builds from the same list.
#include <functional>
#include <memory>
#include <vector>

#include "weave/data/hf/hf_architecture.h"
#include "weave/models/model_split.h"
#include "weave/nn/generation.h"

namespace weave::models::detail {

/// Llama and Qwen 2 (models/llama/llama_hf.cpp).
data::hf::ArchitectureSpec llama_architecture();
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

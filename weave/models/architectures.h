#pragma once
// Each architecture folder's Hugging Face description (internal to weave/models): what
// architectures.cpp lists for data/hf (data::hf::architectures()).
#include "weave/data/hf/hf_architecture.h"

namespace weave::models::detail {

/// Llama and Qwen 2 (models/llama/llama_hf.cpp).
data::hf::ArchitectureSpec llama_architecture();
/// GPT-2 (models/gpt2/gpt2_hf.cpp).
data::hf::ArchitectureSpec gpt2_architecture();

}  // namespace weave::models::detail

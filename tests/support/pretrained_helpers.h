#pragma once
// What the suites that load Hugging Face checkpoints over ranks share: the split model of a
// checkpoint's architecture, and FSDP units of its blocks.
#include <memory>
#include <string>
#include <vector>

#include "weave/weave.h"

namespace weave::test::pretrained {

/// The tensor-parallel (and context, pipeline) split model of a checkpoint's architecture.
inline std::shared_ptr<nn::CausalLM> split_model(const data::hf::ModelConfig& config,
                                                 const dist::Group& group,
                                                 models::ModelSplit split) {
  split.tensor = group;
  return models::make_model(config, split);
}

/// FSDP units: the blocks (embeddings, norm and head in the root unit: GPT-2's tied head reads
/// the token embedding after the blocks).
inline std::vector<std::string> block_units(const data::hf::ModelConfig& config) {
  std::vector<std::string> units;
  for (int64_t i = 0; i < config.layers; ++i) units.push_back("blocks." + std::to_string(i));
  return units;
}

}  // namespace weave::test::pretrained

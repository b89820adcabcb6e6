// The one list of the architectures weave reads, writes and builds (data/hf asks for their
// descriptions by data::hf::architectures(), models::make_model for their models): a new
// architecture is a folder here and an entry below.
#include "weave/models/architectures.h"

#include "weave/models/gpt2/gpt2.h"
#include "weave/models/llama/llama.h"

namespace weave::models::detail {

const std::vector<Architecture>& model_architectures() {
  static const std::vector<Architecture> all{
      {gpt2_architecture(),
       [](const data::hf::ModelConfig& config, const ModelSplit& split, Generator* generator) {
         return std::make_shared<GPT2>(gpt2_options(config, generator), split);
       }},
      {llama_architecture(),
       [](const data::hf::ModelConfig& config, const ModelSplit& split, Generator* generator) {
         return std::make_shared<Llama>(llama_options(config, generator), split);
       }},
      {gemma_architecture(),
       [](const data::hf::ModelConfig& config, const ModelSplit& split, Generator* generator) {
         return std::make_shared<Llama>(llama_options(config, generator), split);
       }},
  };
  return all;
}

}  // namespace weave::models::detail

namespace weave::data::hf {

const std::vector<ArchitectureSpec>& architectures() {
  static const std::vector<ArchitectureSpec> all = [] {
    std::vector<ArchitectureSpec> specs;
    for (const models::detail::Architecture& a : models::detail::model_architectures())
      specs.push_back(a.hf);
    return specs;
  }();
  return all;
}

}  // namespace weave::data::hf

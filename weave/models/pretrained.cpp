#include "weave/models/pretrained.h"

#include "weave/models/gpt2/gpt2.h"
#include "weave/models/llama/llama.h"
#include "weave/nn/deferred.h"
#include "weave/parallel/checkpoint/pretrained.h"

namespace weave::models {

std::shared_ptr<nn::CausalLM> make_model(const data::hf::ModelConfig& config,
                                         const ModelSplit& split, Generator* generator) {
  if (config.architecture == "gpt2")
    return std::make_shared<GPT2>(gpt2_options(config, generator), split);
  return std::make_shared<Llama>(llama_options(config, generator), split);
}

std::shared_ptr<nn::CausalLM> from_pretrained(const std::string& dir, const ModelSplit& split,
                                              const std::optional<dist::Group>& group,
                                              const data::hf::LoadOptions& options) {
  const dist::KeepAlive alive;  // the reads may outlast weave-run's --hang-timeout
  const data::hf::ModelConfig config = data::hf::read_config(dir);
  std::shared_ptr<nn::CausalLM> model;
  {  // without memory: the load allocates each parameter as it reads it (nothing drawn)
    nn::DeferredInit deferred(0);
    model = make_model(config, split);
  }
  const bool whole = !split.tensor && split.stages == 1 && !split.expert_group;
  if (whole)
    data::hf::load_weights(*model, config, dir, options);
  else
    parallel::load_pretrained(*model, config, dir, group ? *group : dist::world(), options);
  return model;
}

}  // namespace weave::models

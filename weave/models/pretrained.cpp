#include "weave/models/pretrained.h"

#include "weave/models/architectures.h"
#include "weave/nn/deferred.h"
#include "weave/parallel/checkpoint/pretrained.h"

namespace weave::models {

std::shared_ptr<nn::CausalLM> make_model(const data::hf::ModelConfig& config,
                                         const ModelSplit& split, Generator* generator) {
  for (const detail::Architecture& architecture : detail::model_architectures())
    if (architecture.hf.name == config.architecture)
      return architecture.make(config, split, generator);
  data::hf::architecture(config.architecture);  // raises, naming the known ones
  WEAVE_FAIL("make_model", "no architecture '{}'", config.architecture);
}

std::shared_ptr<nn::CausalLM> from_pretrained(const std::string& dir, const ModelSplit& split,
                                              const std::optional<dist::Group>& group,
                                              const data::hf::LoadOptions& options) {
  const dist::KeepAlive alive;  // the reads may outlast weave-run's --hang-timeout
  const data::hf::ModelConfig config = data::hf::read_config(dir);
  std::shared_ptr<nn::CausalLM> model;
  {  // without memory: the load allocates each parameter as it reads it (nothing drawn)
    auto deferred = nn::DeferredInit::for_loading();
    model = make_model(config, split);
  }
  if (split.whole())
    data::hf::load_weights(*model, config, dir, options);
  else
    parallel::load_pretrained(*model, config, dir, group ? *group : dist::world(), options);
  return model;
}

void save_pretrained(nn::Module& model, const data::hf::ModelConfig& config, const std::string& dir,
                     const data::hf::SaveOptions& options,
                     const std::optional<dist::Group>& group) {
  if (!dist::initialized() && !group) {
    data::hf::save_pretrained(model, config, dir, options);
    return;
  }
  parallel::save_pretrained(model, config, dir, options, group ? *group : dist::world());
}

}  // namespace weave::models

#pragma once
// A Hugging Face architecture as data/hf reads and writes it: how its config.json reads into a
// ModelConfig and back, and how weave's parameters are made of the checkpoint's tensors
// (internal to weave). data/hf knows no architecture by name: the models floor keeps each one
// beside its model (weave/models/<arch>/<arch>_hf.cpp) and lists them in
// weave/models/architectures.cpp, which defines architectures(). It is declared here, where the
// readers and writers use it, and defined above, where the architectures live, as a backend's
// functions are declared by the interface it implements; the include floors still point down.
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "weave/data/hf/hf_mapping.h"

namespace weave::data::hf {

struct ArchitectureSpec {
  /// ModelConfig::architecture of its configs (its folder under weave/models/).
  std::string name;
  /// The name in messages ("GPT-2").
  std::string display;
  /// config.json's model_type values it reads ("llama", "qwen2").
  std::vector<std::string> model_types;
  /// config.json (read from `path`) into config's fields; raises, naming path and setting, for
  /// what weave does not implement.
  std::function<void(const nlohmann::json& file, const std::string& path, ModelConfig& config)>
      read;
  /// config's fields into config.json (its other fields are kept): model_type, architectures and
  /// the sizes.
  std::function<void(const ModelConfig& config, nlohmann::json& file)> write;
  /// weave's parameters and their sources, in the checkpoint's order.
  std::function<std::vector<detail::Mapping>(const ModelConfig& config)> mappings;
  /// Whether a checkpoint tensor that no mapping reads is one to pass over: a buffer Hugging
  /// Face saved in older files (GPT-2's attn.bias, Llama's rotary inv_freq), a tied model's
  /// copy of its head. Any other unread tensor is the config's mismatch.
  std::function<bool(const std::string& tensor, const ModelConfig& config)> ignorable;
};

/// Every architecture weave reads and writes (defined by weave/models/architectures.cpp).
const std::vector<ArchitectureSpec>& architectures();
/// The architecture `name` (ModelConfig::architecture); raises, naming the known ones.
const ArchitectureSpec& architecture(const std::string& name);
/// config.json's integer `key`, raising (naming path) when it has none.
int64_t config_integer(const nlohmann::json& file, const char* key, const std::string& path);

}  // namespace weave::data::hf

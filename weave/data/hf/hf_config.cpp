// config.json: the fields every architecture shares, the rest by the architecture's reader.
#include <nlohmann/json.hpp>

#include "weave/data/files.h"
#include "weave/data/hf/hf_architecture.h"
#include "weave/data/hf/hf_checkpoint.h"
#include "weave/data/hf/hf_mapping.h"

namespace weave::data::hf {
namespace {

using json = nlohmann::json;
constexpr const char* kConfig = "hf";

DType dtype_of(const json& config) {
  const std::string name = config.value("torch_dtype", "float32");
  if (name == "bfloat16") return kBFloat16;
  if (name == "float16") return kFloat16;
  return kFloat32;
}

// Sizes past any model's raise before anything is planned from them (a damaged or hostile
// config would otherwise allocate without bound: a mapping per layer, a table per row).
void check_sizes(const ModelConfig& c, const std::string& path) {
  const auto within = [&](const char* what, int64_t value, int64_t most) {
    WEAVE_CHECK(value > 0 && value <= most, kConfig, "{}: {} is {}, outside [1, {}]", path, what,
                value, most);
  };
  within("the layer count", c.layers, 4096);
  within("the width", c.dim, int64_t(1) << 17);
  within("the MLP width", c.hidden, int64_t(1) << 20);
  within("the vocabulary", c.vocab, int64_t(1) << 24);
  within("the head count", c.heads, c.dim);
  within("the key/value head count", c.kv_heads, c.heads);
  if (c.max_positions != 0) within("the position count", c.max_positions, int64_t(1) << 24);
}

}  // namespace

ModelConfig read_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  ModelConfig config;
  config.json = read_file(detail::checkpoint_file(dir, "config.json"));
  json c;
  try {
    c = json::parse(config.json);
    const std::string type = c.value("model_type", "");
    const ArchitectureSpec* spec = nullptr;
    std::string known;
    for (const ArchitectureSpec& candidate : architectures())
      for (const std::string& model_type : candidate.model_types) {
        if (model_type == type) spec = &candidate;
        known += (known.empty() ? "" : ", ") + model_type;
      }
    WEAVE_CHECK(spec != nullptr, kConfig,
                "{}: unknown architecture: model_type '{}'; hint: weave reads {} checkpoints", path,
                type, known);
    config.architecture = spec->name;
    spec->read(c, path, config);
  } catch (const json::exception& e) {
    WEAVE_FAIL(kConfig, "{} is not a config weave can read: {}", path, e.what());
  }
  config.dtype = dtype_of(c);
  check_sizes(config, path);
  return config;
}

std::string config_json(const ModelConfig& config) {
  json c = config.json.empty() ? json::object() : json::parse(config.json);
  c["torch_dtype"] = config.dtype == kBFloat16  ? "bfloat16"
                     : config.dtype == kFloat16 ? "float16"
                                                : "float32";
  c["vocab_size"] = config.vocab;
  c["tie_word_embeddings"] = config.tie_embeddings;
  architecture(config.architecture).write(config, c);
  return c.dump(2);
}

const ArchitectureSpec& architecture(const std::string& name) {
  std::string known;
  for (const ArchitectureSpec& spec : architectures()) {
    if (spec.name == name) return spec;
    known += (known.empty() ? "" : ", ") + spec.name;
  }
  WEAVE_FAIL(kConfig, "no architecture '{}'; hint: weave has {}", name, known);
}

int64_t config_integer(const json& file, const char* key, const std::string& path) {
  WEAVE_CHECK(file.contains(key) && file[key].is_number_integer(), kConfig,
              "{} has no integer '{}'", path, key);
  return file[key].get<int64_t>();
}

}  // namespace weave::data::hf

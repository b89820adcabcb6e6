// config.json of GPT-2 and Llama-family checkpoints.
#include <nlohmann/json.hpp>

#include "weave/data/files.h"
#include "weave/data/hf/hf_checkpoint.h"

namespace weave::data::hf {
namespace {

using json = nlohmann::json;
constexpr const char* kConfig = "hf";

int64_t integer(const json& config, const char* key, const std::string& path) {
  WEAVE_CHECK(config.contains(key) && config[key].is_number_integer(), kConfig,
              "{} has no integer '{}'", path, key);
  return config[key].get<int64_t>();
}

DType dtype_of(const json& config) {
  const std::string name = config.value("torch_dtype", "float32");
  if (name == "bfloat16") return kBFloat16;
  if (name == "float16") return kFloat16;
  return kFloat32;
}

void read_gpt2(const json& c, const std::string& path, ModelConfig& config) {
  config.architecture = Architecture::GPT2;
  config.vocab = integer(c, "vocab_size", path);
  config.dim = integer(c, "n_embd", path);
  config.layers = integer(c, "n_layer", path);
  config.heads = config.kv_heads = integer(c, "n_head", path);
  config.max_positions = integer(c, "n_positions", path);
  config.hidden =
      c.value("n_inner", json()).is_number_integer() ? c["n_inner"].get<int64_t>() : 4 * config.dim;
  config.norm_eps = c.value("layer_norm_epsilon", 1e-5);
  config.tie_embeddings = c.value("tie_word_embeddings", true);
  const std::string act = c.value("activation_function", "gelu_new");
  WEAVE_CHECK(act == "gelu_new" || act == "gelu_pytorch_tanh", kConfig,
              "{}: activation_function '{}' is not supported; hint: GPT-2's is gelu_new", path,
              act);
  WEAVE_CHECK(config.hidden == 4 * config.dim && config.norm_eps == 1e-5 && config.tie_embeddings,
              kConfig,
              "{}: weave's GPT-2 has n_inner = 4 n_embd, layer_norm_epsilon 1e-5 and a tied head, "
              "found {}, {} and tie_word_embeddings {}",
              path, config.hidden, config.norm_eps, config.tie_embeddings);
}

// Llama, or Qwen 2 (Llama with biased q, k and v projections).
void read_llama(const json& c, const std::string& path, ModelConfig& config, bool qwen2) {
  config.architecture = Architecture::Llama;
  config.qkv_bias = qwen2;
  config.vocab = integer(c, "vocab_size", path);
  config.dim = integer(c, "hidden_size", path);
  config.layers = integer(c, "num_hidden_layers", path);
  config.heads = integer(c, "num_attention_heads", path);
  config.kv_heads =
      c.contains("num_key_value_heads") ? integer(c, "num_key_value_heads", path) : config.heads;
  config.hidden = integer(c, "intermediate_size", path);
  config.max_positions = c.value("max_position_embeddings", int64_t(0));
  config.norm_eps = c.value("rms_norm_eps", 1e-6);
  config.rope_theta = c.value("rope_theta", 10000.0);
  config.tie_embeddings = c.value("tie_word_embeddings", false);
  WEAVE_CHECK(config.heads > 0 && config.dim % config.heads == 0, kConfig,
              "{}: hidden_size {} is not a multiple of num_attention_heads {}", path, config.dim,
              config.heads);
  const auto unsupported = [&](bool bad, const std::string& what) {
    WEAVE_CHECK(!bad, kConfig, "{}: {} is not supported", path, what);
  };
  unsupported(c.value("attention_bias", false), "attention_bias true");
  unsupported(c.value("mlp_bias", false), "mlp_bias true");
  unsupported(c.value("hidden_act", "silu") != "silu",
              "hidden_act '" + c.value("hidden_act", "") + "' (Llama's is silu)");
  unsupported(c.value("head_dim", config.dim / config.heads) != config.dim / config.heads,
              "a head_dim other than hidden_size / num_attention_heads");
  if (qwen2)  // Qwen 2 names a window it uses only with use_sliding_window
    unsupported(c.value("use_sliding_window", false), "use_sliding_window true");
  else
    unsupported(c.contains("sliding_window") && !c["sliding_window"].is_null(), "sliding_window");
  const json scaling = c.value("rope_scaling", json());
  if (!scaling.is_null()) {
    const std::string type = scaling.value("rope_type", scaling.value("type", ""));
    unsupported(type != "llama3", "rope_scaling of type '" + type + "' (weave has Llama 3's)");
    config.rope_scaling = Llama3RopeScaling{
        .factor = scaling.at("factor").get<double>(),
        .low_freq_factor = scaling.at("low_freq_factor").get<double>(),
        .high_freq_factor = scaling.at("high_freq_factor").get<double>(),
        .original_max_position = scaling.at("original_max_position_embeddings").get<int64_t>()};
  }
}

}  // namespace

ModelConfig read_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  ModelConfig config;
  config.json = read_file(path);
  json c;
  try {
    c = json::parse(config.json);
    const std::string type = c.value("model_type", "");
    if (type == "gpt2")
      read_gpt2(c, path, config);
    else if (type == "llama" || type == "qwen2")
      read_llama(c, path, config, type == "qwen2");
    else
      WEAVE_FAIL(kConfig,
                 "{}: unknown architecture: model_type '{}'; hint: weave reads gpt2, llama and "
                 "qwen2 checkpoints",
                 path, type);
  } catch (const json::exception& e) {
    WEAVE_FAIL(kConfig, "{} is not a config weave can read: {}", path, e.what());
  }
  config.dtype = dtype_of(c);
  return config;
}

std::string config_json(const ModelConfig& config) {
  json c = config.json.empty() ? json::object() : json::parse(config.json);
  c["torch_dtype"] = config.dtype == kBFloat16  ? "bfloat16"
                     : config.dtype == kFloat16 ? "float16"
                                                : "float32";
  c["vocab_size"] = config.vocab;
  c["tie_word_embeddings"] = config.tie_embeddings;
  if (config.architecture == Architecture::GPT2) {
    c["model_type"] = "gpt2";
    c["architectures"] = {"GPT2LMHeadModel"};
    c["n_embd"] = config.dim, c["n_layer"] = config.layers, c["n_head"] = config.heads;
    c["n_positions"] = config.max_positions, c["layer_norm_epsilon"] = config.norm_eps;
    c["activation_function"] = c.value("activation_function", "gelu_new");
    return c.dump(2);
  }
  c["model_type"] = config.qkv_bias ? "qwen2" : "llama";
  c["architectures"] = {config.qkv_bias ? "Qwen2ForCausalLM" : "LlamaForCausalLM"};
  c["hidden_size"] = config.dim, c["num_hidden_layers"] = config.layers;
  c["num_attention_heads"] = config.heads, c["num_key_value_heads"] = config.kv_heads;
  c["intermediate_size"] = config.hidden, c["rms_norm_eps"] = config.norm_eps;
  c["rope_theta"] = config.rope_theta, c["hidden_act"] = "silu";
  if (config.max_positions > 0) c["max_position_embeddings"] = config.max_positions;
  if (config.rope_scaling)
    c["rope_scaling"] = {
        {"rope_type", "llama3"},
        {"factor", config.rope_scaling->factor},
        {"low_freq_factor", config.rope_scaling->low_freq_factor},
        {"high_freq_factor", config.rope_scaling->high_freq_factor},
        {"original_max_position_embeddings", config.rope_scaling->original_max_position}};
  return c.dump(2);
}

}  // namespace weave::data::hf

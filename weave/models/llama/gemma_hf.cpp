// Gemma's Hugging Face side (Gemma2ForCausalLM, model_type gemma2; Gemma3ForCausalLM, model_type
// gemma3_text): a Llama-class model whose RMSNorms scale by (1 + weight), with norms after the
// attention and the MLP too, GeGLU with tanh GELU, the embedding scaled by sqrt(hidden_size), a
// tied head by default, the attention scaled by query_pre_attn_scalar^-1/2, local (windowed) and
// global layers, and Gemma 2's soft-caps of the attention scores and the logits; Gemma 3 adds
// (1 + w) RMSNorms of q and k and a rotary base of its own for the local layers. The weights'
// names are Llama's (llama_mappings) with Gemma's four norms a block.
#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "weave/models/architectures.h"
#include "weave/models/llama/llama.h"

namespace weave::models {

namespace {

using json = nlohmann::json;
using data::hf::config_integer;
constexpr const char* kGemmaHf = "hf";

// A number or null (0) of config.json, raising for anything else.
double number_or_none(const json& c, const char* key, const std::string& path) {
  const json value = c.value(key, json());
  if (value.is_null()) return 0;
  WEAVE_CHECK(value.is_number() && value.get<double>() > 0, kGemmaHf,
              "{}: {} must be a positive number or null, found {}", path, key, value.dump());
  return value.get<double>();
}

// Which layers are local (windowed): layer_types where given; else Gemma 2's even layers, or
// Gemma 3's all but every sliding_window_pattern-th.
std::vector<bool> local_layers(const json& c, const std::string& path, bool gemma3,
                               int64_t layers) {
  if (auto types = detail::read_layer_types(c, path, layers)) return *types;
  std::vector<bool> local;
  const int64_t pattern = gemma3 ? c.value("sliding_window_pattern", int64_t(6)) : 2;
  WEAVE_CHECK(pattern > 0, kGemmaHf, "{}: sliding_window_pattern {} must be positive", path,
              pattern);
  for (int64_t i = 0; i < layers; ++i) local.push_back((i + 1) % pattern != 0);
  return local;
}

void read_rope(const json& c, const std::string& path, bool gemma3, data::hf::ModelConfig& config) {
  config.rope_theta = c.value("rope_theta", gemma3 ? 1000000.0 : 10000.0);
  if (gemma3) config.rope_local_theta = c.value("rope_local_base_freq", 10000.0);
  const json scaling = c.value("rope_scaling", json());
  const std::string type =
      scaling.is_object() ? scaling.value("rope_type", scaling.value("type", "")) : "";
  if (scaling.is_null() || type == "default") return;
  WEAVE_CHECK(gemma3 && type == "linear", kGemmaHf,
              "{}: rope_scaling of type '{}' is not supported for model_type {} (Gemma 3's "
              "linear scaling is)",
              path, type, config.model_type);
  config.rope_linear_factor = scaling.at("factor").get<double>();
}

void read_gemma(const json& c, const std::string& path, data::hf::ModelConfig& config) {
  config.model_type = c.value("model_type", "");
  const bool gemma3 = config.model_type == "gemma3_text";
  config.qk_norm = gemma3;
  detail::read_llama_sizes(c, path, config);
  config.tie_embeddings = c.value("tie_word_embeddings", true);
  config.head_dim = c.contains("head_dim") ? config_integer(c, "head_dim", path) : 256;
  config.query_pre_attn_scalar = c.value("query_pre_attn_scalar", 256.0);
  config.attention_softcap = number_or_none(c, "attn_logit_softcapping", path);
  config.logit_softcap = number_or_none(c, "final_logit_softcapping", path);
  read_rope(c, path, gemma3, config);
  const auto unsupported = [&](bool bad, const std::string& what) {
    WEAVE_CHECK(!bad, kGemmaHf, "{}: {} is not supported", path, what);
  };
  const std::string activation = c.value("hidden_activation", "gelu_pytorch_tanh");
  unsupported(activation != "gelu_pytorch_tanh",
              "hidden_activation '" + activation + "' (Gemma's is gelu_pytorch_tanh)");
  unsupported(c.value("attention_bias", false), "attention_bias true");
  unsupported(c.value("use_bidirectional_attention", false), "use_bidirectional_attention true");
  unsupported(c.value("attention_dropout", 0.0) != 0.0,
              "attention_dropout " + c.value("attention_dropout", json(0.0)).dump() +
                  " (weave's attention has no dropout)");
  WEAVE_CHECK(config.query_pre_attn_scalar > 0, kGemmaHf,
              "{}: query_pre_attn_scalar must be positive, found {}", path,
              config.query_pre_attn_scalar);
  const std::vector<bool> local = local_layers(c, path, gemma3, config.layers);
  const bool any_local = std::find(local.begin(), local.end(), true) != local.end();
  if (any_local) {
    WEAVE_CHECK(c.contains("sliding_window") && !c["sliding_window"].is_null(), kGemmaHf,
                "{}: local layers need a sliding_window, found none", path);
    config.sliding_window = config_integer(c, "sliding_window", path);
    WEAVE_CHECK(config.sliding_window > 0, kGemmaHf, "{}: sliding_window {} must be positive", path,
                config.sliding_window);
    if (std::find(local.begin(), local.end(), false) != local.end()) config.windowed_layers = local;
  }
}

void write_gemma(const data::hf::ModelConfig& config, json& c) {
  const bool gemma3 = config.qk_norm;
  c["model_type"] = gemma3 ? "gemma3_text" : "gemma2";
  c["architectures"] = {gemma3 ? "Gemma3ForCausalLM" : "Gemma2ForCausalLM"};
  c["hidden_size"] = config.dim, c["num_hidden_layers"] = config.layers;
  c["num_attention_heads"] = config.heads, c["num_key_value_heads"] = config.kv_heads;
  c["intermediate_size"] = config.hidden, c["rms_norm_eps"] = config.norm_eps;
  c["head_dim"] = config.head_dim > 0 ? config.head_dim : config.dim / config.heads;
  c["query_pre_attn_scalar"] = config.query_pre_attn_scalar;
  c["hidden_activation"] = "gelu_pytorch_tanh", c["rope_theta"] = config.rope_theta;
  if (config.max_positions > 0) c["max_position_embeddings"] = config.max_positions;
  const auto none_if_zero = [](double value) { return value > 0 ? json(value) : json(); };
  c["attn_logit_softcapping"] = none_if_zero(config.attention_softcap);
  c["final_logit_softcapping"] = none_if_zero(config.logit_softcap);
  if (gemma3) {
    c["rope_local_base_freq"] = config.rope_local_theta;
    c["rope_scaling"] = config.rope_linear_factor == 1
                            ? json()
                            : json{{"rope_type", "linear"}, {"factor", config.rope_linear_factor}};
  }
  const bool windowed = config.sliding_window > 0;
  c["sliding_window"] = windowed ? json(config.sliding_window) : json();
  json types = json::array();
  for (int64_t i = 0; i < config.layers; ++i) {
    const bool local =
        windowed && (config.windowed_layers.empty() || config.windowed_layers[size_t(i)]);
    types.push_back(local ? "sliding_attention" : "full_attention");
  }
  c["layer_types"] = types;
}

}  // namespace

namespace detail {

data::hf::ArchitectureSpec gemma_architecture() {
  return {.name = "gemma",
          .display = "Gemma",
          .model_types = {"gemma2", "gemma3_text"},
          .read = read_gemma,
          .write = write_gemma,
          .mappings = llama_mappings,
          .ignorable = llama_ignorable};
}

LlamaOptions gemma_options(const data::hf::ModelConfig& config, Generator* generator) {
  LlamaOptions options{.vocab = config.vocab, .dim = config.dim, .layers = config.layers};
  LlamaBlockOptions& block = options.block;
  block.heads = config.heads, block.kv_heads = config.kv_heads, block.hidden = config.hidden;
  block.rotary =
      RotaryOptions{.base = config.rope_theta, .linear_factor = config.rope_linear_factor};
  block.activation = nn::GatedActivation::GELUTanh;
  block.norm_eps = config.norm_eps, block.head_dim = config.head_dim;
  if (config.qk_norm)
    block.qk_norm = nn::HeadNormOptions{.eps = config.norm_eps, .unit_offset = true};
  block.attention_scale = 1.0 / std::sqrt(config.query_pre_attn_scalar);
  block.window = config.sliding_window, block.attention_softcap = config.attention_softcap;
  block.norm_unit_offset = true, block.post_norms = true;
  options.tie_embeddings = config.tie_embeddings;
  options.windowed_layers = config.windowed_layers;
  if (config.rope_local_theta > 0)
    options.windowed_rotary = RotaryOptions{.base = config.rope_local_theta};
  options.logit_softcap = config.logit_softcap, options.scale_embedding = true;
  options.generator = generator;
  return options;
}

data::hf::ModelConfig gemma_config(const LlamaOptions& options, DType dtype) {
  const LlamaBlockOptions& block = options.block;
  const RotaryOptions rotary = block.rotary.value_or(RotaryOptions{});
  const bool gemma3 = block.qk_norm.has_value();
  const bool head_norms_fit =
      !gemma3 || (block.qk_norm->unit_offset && block.qk_norm->eps == block.norm_eps);
  const bool local_rotary_fits =
      !options.windowed_rotary ||
      (gemma3 && !options.windowed_rotary->interleaved &&
       options.windowed_rotary->rotary_dim == 0 && !options.windowed_rotary->llama3_scaling &&
       options.windowed_rotary->linear_factor == 1);
  WEAVE_CHECK(block.post_norms && block.norm_unit_offset && options.scale_embedding &&
                  block.activation == nn::GatedActivation::GELUTanh && block.rotary &&
                  !rotary.interleaved && rotary.rotary_dim == 0 && !rotary.llama3_scaling &&
                  (gemma3 || rotary.linear_factor == 1) && block.causal && !block.qkv_bias &&
                  !block.moe && head_norms_fit && local_rotary_fits,
              kGemmaHf,
              "Hugging Face's Gemma takes (1 + w) norms before and after the attention and the "
              "MLP, a scaled embedding, GeGLU with tanh GELU, causal blocks without biases or "
              "experts, rotary in the rotate-half layout over whole heads (linear scaling and "
              "a local base Gemma 3's only) and (Gemma 3) (1 + w) q/k norms with the blocks' "
              "eps; found post_norms {}, norm_unit_offset {}, scale_embedding {}, GeGLU tanh {}, "
              "q/k norms fitting {}, local rotary fitting {}",
              block.post_norms, block.norm_unit_offset, options.scale_embedding,
              block.activation == nn::GatedActivation::GELUTanh, head_norms_fit, local_rotary_fits);
  data::hf::ModelConfig config;
  config.architecture = "gemma", config.dtype = dtype;
  config.vocab = options.vocab, config.dim = options.dim, config.layers = options.layers;
  config.heads = block.heads, config.kv_heads = block.kv_heads > 0 ? block.kv_heads : block.heads;
  config.hidden = block.hidden > 0 ? block.hidden : llama_hidden(options.dim);
  config.head_dim = block.head_dim > 0 ? block.head_dim : options.dim / block.heads;
  config.norm_eps = block.norm_eps, config.rope_theta = rotary.base;
  config.rope_linear_factor = rotary.linear_factor, config.qk_norm = gemma3;
  config.rope_local_theta = options.windowed_rotary ? options.windowed_rotary->base
                            : gemma3                ? rotary.base
                                                    : 0;
  const double scale = block.attention_scale.value_or(1.0 / std::sqrt(double(config.head_dim)));
  const double scalar = 1.0 / (scale * scale);  // an integer in every Gemma config: kept one
  config.query_pre_attn_scalar =
      std::abs(scalar - std::round(scalar)) < 1e-9 * scalar ? std::round(scalar) : scalar;
  config.attention_softcap = block.attention_softcap, config.logit_softcap = options.logit_softcap;
  config.tie_embeddings = options.tie_embeddings;
  config.sliding_window = block.window;
  config.windowed_layers = block.window > 0 ? options.windowed_layers : std::vector<bool>{};
  return config;
}

}  // namespace detail

}  // namespace weave::models

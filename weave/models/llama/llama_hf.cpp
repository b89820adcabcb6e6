// Llama's Hugging Face side (LlamaForCausalLM; MistralForCausalLM: Llama with a sliding window
// and a head_dim of its own; Qwen2ForCausalLM: Llama with biased q, k and v projections;
// Qwen3ForCausalLM: Llama with per-head RMSNorms of q and k; the Qwens with windows on the layers
// from max_window_layers on): config.json's fields, the checkpoint's names and layouts of weave's
// parameters, and the model options of a config and back.
#include <algorithm>
#include <nlohmann/json.hpp>

#include "weave/models/architectures.h"
#include "weave/models/llama/llama.h"

namespace weave::models {

namespace {

using json = nlohmann::json;
using data::hf::config_integer;
using data::hf::detail::Layout;
using data::hf::detail::Mapping;
constexpr const char* kLlamaHf = "hf";

int64_t head_dim_of(const data::hf::ModelConfig& c) {
  return c.head_dim > 0 ? c.head_dim : c.dim / c.heads;
}

// The sliding window and the layers it applies to: Mistral's sliding_window (every layer; null:
// none), the Qwens' with use_sliding_window on layers max_window_layers onwards, or layer_types
// (Hugging Face's newer list of "sliding_attention" and "full_attention") where present.
void read_windows(const json& c, const std::string& path, data::hf::ModelConfig& config) {
  const std::string& model_type = config.model_type;
  const bool qwen = model_type.starts_with("qwen");
  const json window = c.value("sliding_window", json());
  const bool windowed = qwen ? c.value("use_sliding_window", false) : !window.is_null();
  WEAVE_CHECK(!windowed || model_type != "llama", kLlamaHf,
              "{}: sliding_window is not supported for model_type llama (Hugging Face's Llama "
              "has no window); hint: model_type mistral",
              path);
  if (!windowed) return;
  config.sliding_window = config_integer(c, "sliding_window", path);
  WEAVE_CHECK(config.sliding_window > 0, kLlamaHf, "{}: sliding_window {} must be positive", path,
              config.sliding_window);
  if (qwen) {
    const int64_t first = c.value("max_window_layers", config.layers);
    for (int64_t i = 0; i < config.layers; ++i) config.windowed_layers.push_back(i >= first);
  }
  if (const auto types = detail::read_layer_types(c, path, config.layers)) {
    const bool every_layer = std::find(types->begin(), types->end(), false) == types->end();
    WEAVE_CHECK(qwen || every_layer, kLlamaHf,
                "{}: layer_types with full_attention layers is not supported for model_type {} "
                "(Hugging Face's windows every layer)",
                path, model_type);
    config.windowed_layers = *types;
  }
  const auto& layers = config.windowed_layers;
  if (std::all_of(layers.begin(), layers.end(), [](bool w) { return w; }))
    config.windowed_layers.clear();  // every layer: as none listed
  else if (std::none_of(layers.begin(), layers.end(), [](bool w) { return w; }))
    config.windowed_layers.clear(), config.sliding_window = 0;
}

// Llama, Mistral (Llama with a window), Qwen 2 (Llama with biased q, k and v projections) or
// Qwen 3 (Llama with q_norm and k_norm and any head_dim).
void read_llama(const json& c, const std::string& path, data::hf::ModelConfig& config) {
  const std::string model_type = c.value("model_type", "");
  config.model_type = model_type;
  config.qkv_bias = model_type == "qwen2" || model_type == "qwen2_moe";
  config.qk_norm = model_type == "qwen3" || model_type == "qwen3_moe";
  detail::read_llama_sizes(c, path, config);
  config.rope_theta = c.value("rope_theta", 10000.0);
  config.tie_embeddings = c.value("tie_word_embeddings", false);
  const json head_dim = c.value("head_dim", json());
  if (!head_dim.is_null())
    config.head_dim = config_integer(c, "head_dim", path);
  else if (config.qk_norm)
    config.head_dim = 128;  // Qwen3Config's default
  WEAVE_CHECK(config.heads > 0 && (config.head_dim > 0 || config.dim % config.heads == 0), kLlamaHf,
              "{}: hidden_size {} is not a multiple of num_attention_heads {} (and no head_dim "
              "says the heads' size)",
              path, config.dim, config.heads);
  const auto unsupported = [&](bool bad, const std::string& what) {
    WEAVE_CHECK(!bad, kLlamaHf, "{}: {} is not supported", path, what);
  };

  unsupported(c.value("attention_bias", false), "attention_bias true");
  unsupported(c.value("mlp_bias", false), "mlp_bias true");
  unsupported(c.value("hidden_act", "silu") != "silu",
              "hidden_act '" + c.value("hidden_act", "") + "' (Llama's is silu)");
  read_windows(c, path, config);
  detail::read_experts(c, path, config);
  unsupported(c.value("attention_dropout", 0.0) != 0.0,
              "attention_dropout " + c.value("attention_dropout", json(0.0)).dump() +
                  " (weave's attention has no dropout)");
  const json scaling = c.value("rope_scaling", json());
  const std::string type =
      scaling.is_object() ? scaling.value("rope_type", scaling.value("type", "")) : "";
  if (!scaling.is_null() && type != "default") {  // "default": no scaling, as null
    unsupported(type != "llama3", "rope_scaling of type '" + type + "' (weave has Llama 3's)");
    config.rope_scaling = Llama3RopeScaling{
        .factor = scaling.at("factor").get<double>(),
        .low_freq_factor = scaling.at("low_freq_factor").get<double>(),
        .high_freq_factor = scaling.at("high_freq_factor").get<double>(),
        .original_max_position = scaling.at("original_max_position_embeddings").get<int64_t>()};
  }
}

// model_type as read, or for a config built here the one its features name.
std::string model_type_of(const data::hf::ModelConfig& config) {
  if (!config.model_type.empty()) return config.model_type;
  if (config.experts > 0)
    return config.qk_norm ? "qwen3_moe" : config.qkv_bias ? "qwen2_moe" : "mixtral";
  if (config.qk_norm) return "qwen3";
  if (config.qkv_bias) return "qwen2";
  return config.sliding_window > 0 ? "mistral" : "llama";
}

// The window as each model type writes it (read_windows reads it back).
void write_windows(const data::hf::ModelConfig& config, const std::string& type, json& c) {
  const std::vector<bool>& layers = config.windowed_layers;
  const bool windowed = config.sliding_window > 0;
  WEAVE_CHECK(!windowed || type != "llama", kLlamaHf,
              "Hugging Face's Llama has no sliding window; hint: export as model_type mistral");
  if (type == "mistral" || type == "mixtral") {
    WEAVE_CHECK(layers.empty(), kLlamaHf,
                "Hugging Face's Mistral windows every layer or none; found windows on some "
                "layers only (windowed_layers)");
    c["sliding_window"] = windowed ? json(config.sliding_window) : json();
    return;
  }
  if (type == "llama") return;
  c["use_sliding_window"] = windowed;
  c["sliding_window"] = windowed ? json(config.sliding_window) : json();
  if (!windowed) return;
  const auto first = std::find(layers.begin(), layers.end(), true);  // windowed from here on
  c["max_window_layers"] = layers.empty() ? 0 : int64_t(first - layers.begin());
  json types = json::array();
  for (int64_t i = 0; i < config.layers; ++i)
    types.push_back(layers.empty() || layers[size_t(i)] ? "sliding_attention" : "full_attention");
  c["layer_types"] = types;
}

void write_llama(const data::hf::ModelConfig& config, json& c) {
  const bool qwen3 = config.qk_norm;
  const std::string type = model_type_of(config);
  const char* names[][2] = {
      {"llama", "LlamaForCausalLM"},       {"mistral", "MistralForCausalLM"},
      {"qwen2", "Qwen2ForCausalLM"},       {"qwen3", "Qwen3ForCausalLM"},
      {"mixtral", "MixtralForCausalLM"},   {"qwen3_moe", "Qwen3MoeForCausalLM"},
      {"qwen2_moe", "Qwen2MoeForCausalLM"}};
  c["model_type"] = type;
  for (const auto& [model_type, architecture] : names)
    if (type == model_type) c["architectures"] = {architecture};
  write_windows(config, type, c);
  // Qwen 3 without head_dim would be read as 128 (Qwen3Config's default): always say it.
  if (config.head_dim > 0 || qwen3) c["head_dim"] = head_dim_of(config);
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
  detail::write_experts(config, c);
}

}  // namespace

namespace detail {

void read_llama_sizes(const json& c, const std::string& path, data::hf::ModelConfig& config) {
  config.vocab = config_integer(c, "vocab_size", path);
  config.dim = config_integer(c, "hidden_size", path);
  config.layers = config_integer(c, "num_hidden_layers", path);
  config.heads = config_integer(c, "num_attention_heads", path);
  config.kv_heads = c.contains("num_key_value_heads")
                        ? config_integer(c, "num_key_value_heads", path)
                        : config.heads;
  config.hidden = config_integer(c, "intermediate_size", path);
  config.max_positions = c.value("max_position_embeddings", int64_t(0));
  config.norm_eps = c.value("rms_norm_eps", 1e-6);
}

std::optional<std::vector<bool>> read_layer_types(const json& c, const std::string& path,
                                                  int64_t layers) {
  const json types = c.value("layer_types", json());
  if (types.is_null()) return std::nullopt;
  WEAVE_CHECK(types.is_array() && int64_t(types.size()) == layers, kLlamaHf,
              "{}: layer_types must list one type for each of the {} layers, found {}", path,
              layers, types.dump());
  std::vector<bool> sliding;
  for (const json& type : types) {
    const std::string name = type.is_string() ? type.get<std::string>() : type.dump();
    WEAVE_CHECK(name == "sliding_attention" || name == "full_attention", kLlamaHf,
                "{}: layer_types entry '{}' is not supported (sliding_attention or "
                "full_attention)",
                path, name);
    sliding.push_back(name == "sliding_attention");
  }
  return sliding;
}

std::vector<Mapping> llama_mappings(const data::hf::ModelConfig& c) {
  // Gemma's four norms a block: the one Llama calls post_attention_layernorm (before the MLP) is
  // its pre_feedforward_layernorm; its post_attention_layernorm follows the attention.
  const bool gemma = c.architecture == "gemma";
  const char* before_mlp = gemma ? "pre_feedforward_layernorm." : "post_attention_layernorm.";
  const int64_t D = c.dim, F = c.hidden, HD = head_dim_of(c), Q = c.heads * HD,
                KV = c.kv_heads * HD;
  std::vector<Mapping> m{
      {"embedding.weight", {"model.embed_tokens.weight"}, Layout::Same, {{c.vocab, D}}}};
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string w = "blocks." + std::to_string(i) + ".";
    const std::string h = "model.layers." + std::to_string(i) + ".";
    m.push_back({w + "norm1.weight", {h + "input_layernorm.weight"}, Layout::Same, {{D}}});
    m.push_back(
        {w + "attention.q.weight", {h + "self_attn.q_proj.weight"}, Layout::Same, {{Q, D}}});
    m.push_back({w + "attention.kv",
                 {h + "self_attn.k_proj.weight", h + "self_attn.v_proj.weight"},
                 Layout::Stacked,
                 {{KV, D}, {KV, D}}});
    if (c.qkv_bias) {
      m.push_back({w + "attention.q.bias", {h + "self_attn.q_proj.bias"}, Layout::Same, {{Q}}});
      m.push_back({w + "attention.kv_bias",
                   {h + "self_attn.k_proj.bias", h + "self_attn.v_proj.bias"},
                   Layout::Stacked,
                   {{KV}, {KV}}});
    }
    m.push_back(
        {w + "attention.out.weight", {h + "self_attn.o_proj.weight"}, Layout::Same, {{D, Q}}});
    if (c.qk_norm) {
      m.push_back({w + "attention.q_norm", {h + "self_attn.q_norm.weight"}, Layout::Same, {{HD}}});
      m.push_back({w + "attention.k_norm", {h + "self_attn.k_norm.weight"}, Layout::Same, {{HD}}});
    }
    if (gemma)
      m.push_back(
          {w + "post_norm1.weight", {h + "post_attention_layernorm.weight"}, Layout::Same, {{D}}});
    m.push_back(
        {w + "norm2.weight", {h + before_mlp + std::string("weight")}, Layout::Same, {{D}}});
    if (gemma)
      m.push_back({w + "post_norm2.weight",
                   {h + "post_feedforward_layernorm.weight"},
                   Layout::Same,
                   {{D}}});
    if (c.experts > 0) {
      add_expert_mappings(c, w, h, m);
      continue;
    }
    m.push_back({w + "mlp.gate_up",
                 {h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"},
                 Layout::Stacked,
                 {{F, D}, {F, D}}});
    m.push_back({w + "mlp.down.weight", {h + "mlp.down_proj.weight"}, Layout::Same, {{D, F}}});
  }
  m.push_back({"norm.weight", {"model.norm.weight"}, Layout::Same, {{D}}});
  if (!c.tie_embeddings)
    m.push_back({"head.weight", {"lm_head.weight"}, Layout::Same, {{c.vocab, D}}});
  return m;
}

// The rotary frequencies older files hold (weave computes them), and a tied model's head copy.
bool llama_ignorable(const std::string& tensor, const data::hf::ModelConfig& config) {
  return tensor.ends_with(".rotary_emb.inv_freq") ||
         (config.tie_embeddings && tensor == "lm_head.weight");
}

data::hf::ArchitectureSpec llama_architecture() {
  return {
      .name = "llama",
      .display = "Llama",
      .model_types = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"},
      .read = read_llama,
      .write = write_llama,
      .mappings = llama_mappings,
      .ignorable = llama_ignorable};
}

}  // namespace detail

LlamaOptions llama_options(const data::hf::ModelConfig& config, Generator* generator) {
  if (config.architecture == "gemma") return detail::gemma_options(config, generator);
  WEAVE_CHECK(config.architecture == "llama", kLlamaHf,
              "llama_options needs a Llama or Gemma configuration, found {}'s",
              config.architecture);
  const RotaryOptions rotary{.base = config.rope_theta, .llama3_scaling = config.rope_scaling};
  return {.vocab = config.vocab,
          .dim = config.dim,
          .layers = config.layers,
          .block = {.heads = config.heads,
                    .kv_heads = config.kv_heads,
                    .hidden = config.hidden,
                    .rotary = rotary,
                    .norm_eps = config.norm_eps,
                    .qkv_bias = config.qkv_bias,
                    .head_dim = config.head_dim,
                    .qk_norm = config.qk_norm ? std::optional<nn::HeadNormOptions>(
                                                    nn::HeadNormOptions{.eps = config.norm_eps})
                                              : std::nullopt,
                    .window = config.sliding_window,
                    .moe = detail::experts_of(config)},
          .tie_embeddings = config.tie_embeddings,
          .windowed_layers = config.windowed_layers,
          .generator = generator};
}

data::hf::ModelConfig model_config(const LlamaOptions& options, DType dtype) {
  const LlamaBlockOptions& block = options.block;
  if (block.post_norms || block.norm_unit_offset || options.scale_embedding)
    return detail::gemma_config(options, dtype);
  const RotaryOptions rotary = block.rotary.value_or(RotaryOptions{});
  WEAVE_CHECK(
      !block.attention_scale &&
          (!block.qk_norm || (!block.qk_norm->unit_offset && block.qk_norm->eps == block.norm_eps)),
      kLlamaHf,
      "Hugging Face's Llama and Qwen scale attention by 1 / sqrt(head_dim) and norm q and k "
      "(Qwen 3) by weights, with the blocks' eps; found attention_scale {}, qk_norm "
      "unit_offset {}",
      block.attention_scale.value_or(0), block.qk_norm && block.qk_norm->unit_offset);
  WEAVE_CHECK(block.rotary && !rotary.interleaved && rotary.rotary_dim == 0 && block.causal &&
                  block.activation == nn::GatedActivation::SiLU,
              kLlamaHf,
              "Hugging Face's Llama takes causal blocks with SwiGLU and rotary positions in the "
              "rotate-half layout over whole heads; found rotary {}, interleaved {}, rotary_dim "
              "{}, causal {}, SwiGLU {}",
              block.rotary.has_value(), rotary.interleaved, rotary.rotary_dim, block.causal,
              block.activation == nn::GatedActivation::SiLU);
  data::hf::ModelConfig config;
  config.architecture = "llama";
  config.vocab = options.vocab, config.dim = options.dim, config.layers = options.layers;
  config.heads = block.heads, config.kv_heads = block.kv_heads > 0 ? block.kv_heads : block.heads;
  config.hidden = block.hidden > 0 ? block.hidden : llama_hidden(options.dim);
  config.norm_eps = block.norm_eps, config.rope_theta = rotary.base;
  config.rope_scaling = rotary.llama3_scaling, config.tie_embeddings = options.tie_embeddings;
  config.qkv_bias = block.qkv_bias, config.dtype = dtype;
  config.qk_norm = block.qk_norm.has_value(), config.head_dim = block.head_dim;
  WEAVE_CHECK(
      block.attention_softcap == 0 && options.logit_softcap == 0 && !options.windowed_rotary,
      kLlamaHf,
      "Hugging Face's Llama, Mistral and Qwen have no soft-caps and one rotary for every "
      "layer; found attention_softcap {}, logit_softcap {}, windowed_rotary {}",
      block.attention_softcap, options.logit_softcap, options.windowed_rotary.has_value());
  config.sliding_window = block.window;
  config.windowed_layers = block.window > 0 ? options.windowed_layers : std::vector<bool>{};
  detail::set_experts(block.moe, config);
  if (config.experts > 0 && !config.qk_norm && !config.qkv_bias)
    config.hidden = config.expert_hidden;  // Mixtral's experts are intermediate_size wide
  WEAVE_CHECK(
      !(config.qk_norm && config.qkv_bias), kLlamaHf,
      "no Hugging Face architecture has Qwen 3's q/k norms with Qwen 2's q, k and v biases; "
      "hint: one or the other");
  return config;
}

}  // namespace weave::models

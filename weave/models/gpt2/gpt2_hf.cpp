// GPT-2's Hugging Face side (GPT2LMHeadModel): config.json's fields, the checkpoint's names and
// layouts of weave's parameters (Conv1D weights [in, out], c_attn's q, k and v side by side),
// and the model options of a config and back.
#include <nlohmann/json.hpp>

#include "weave/models/architectures.h"
#include "weave/models/gpt2/gpt2.h"

namespace weave::models {

namespace {

using json = nlohmann::json;
using data::hf::config_integer;
using data::hf::detail::Layout;
using data::hf::detail::Mapping;
constexpr const char* kGPT2Hf = "hf";

void read_gpt2(const json& c, const std::string& path, data::hf::ModelConfig& config) {
  config.vocab = config_integer(c, "vocab_size", path);
  config.dim = config_integer(c, "n_embd", path);
  config.layers = config_integer(c, "n_layer", path);
  config.heads = config.kv_heads = config_integer(c, "n_head", path);
  config.max_positions = config_integer(c, "n_positions", path);
  config.hidden =
      c.value("n_inner", json()).is_number_integer() ? c["n_inner"].get<int64_t>() : 4 * config.dim;
  config.norm_eps = c.value("layer_norm_epsilon", 1e-5);
  config.tie_embeddings = c.value("tie_word_embeddings", true);
  const std::string act = c.value("activation_function", "gelu_new");
  WEAVE_CHECK(act == "gelu_new" || act == "gelu_pytorch_tanh", kGPT2Hf,
              "{}: activation_function '{}' is not supported; hint: GPT-2's is gelu_new", path,
              act);
  // Settings that change GPT2LMHeadModel's forward and that weave's GPT-2 does not implement.
  // (The dropouts change only training, which weave's GPT-2 runs without dropout.)
  const auto unsupported = [&](bool bad, const std::string& what) {
    WEAVE_CHECK(!bad, kGPT2Hf,
                "{}: {} is not supported (weave's GPT-2 attends as GPT-2's defaults say: "
                "scores scaled by 1/sqrt(head size), in the model's dtype, no cross-attention)",
                path, what);
  };
  unsupported(!c.value("scale_attn_weights", true), "scale_attn_weights false");
  unsupported(c.value("scale_attn_by_inverse_layer_idx", false),
              "scale_attn_by_inverse_layer_idx true");
  unsupported(c.value("reorder_and_upcast_attn", false), "reorder_and_upcast_attn true");
  unsupported(c.value("add_cross_attention", false), "add_cross_attention true");
  WEAVE_CHECK(config.hidden == 4 * config.dim && config.norm_eps == 1e-5 && config.tie_embeddings,
              kGPT2Hf,
              "{}: weave's GPT-2 has n_inner = 4 n_embd, layer_norm_epsilon 1e-5 and a tied head, "
              "found {}, {} and tie_word_embeddings {}",
              path, config.hidden, config.norm_eps, config.tie_embeddings);
}

void write_gpt2(const data::hf::ModelConfig& config, json& c) {
  c["model_type"] = "gpt2";
  c["architectures"] = {"GPT2LMHeadModel"};
  c["n_embd"] = config.dim, c["n_layer"] = config.layers, c["n_head"] = config.heads;
  c["n_positions"] = config.max_positions, c["layer_norm_epsilon"] = config.norm_eps;
  c["activation_function"] = c.value("activation_function", "gelu_new");
}

std::vector<Mapping> gpt2_mappings(const data::hf::ModelConfig& c) {
  const int64_t D = c.dim, F = c.hidden;
  std::vector<Mapping> m{
      {"tokens.weight", {"transformer.wte.weight"}, Layout::Same, {{c.vocab, D}}},
      {"positions.weight", {"transformer.wpe.weight"}, Layout::Same, {{c.max_positions, D}}}};
  const auto add = [&](std::string weave, std::string source, Layout layout, Shape shape) {
    m.push_back({std::move(weave), {std::move(source)}, layout, {std::move(shape)}});
  };
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string w = "blocks." + std::to_string(i) + ".";
    const std::string h = "transformer.h." + std::to_string(i) + ".";
    for (auto [mine, theirs] : {std::pair{"norm1", "ln_1"}, std::pair{"norm2", "ln_2"}}) {
      add(w + mine + ".weight", h + theirs + ".weight", Layout::Same, {D});
      add(w + mine + ".bias", h + theirs + ".bias", Layout::Same, {D});
    }
    add(w + "attention.qkv.weight", h + "attn.c_attn.weight", Layout::HeadsQKV, {D, 3 * D});
    add(w + "attention.qkv.bias", h + "attn.c_attn.bias", Layout::HeadsQKV, {3 * D});
    add(w + "attention.out.weight", h + "attn.c_proj.weight", Layout::Transposed, {D, D});
    add(w + "attention.out.bias", h + "attn.c_proj.bias", Layout::Same, {D});
    add(w + "mlp.fc1.weight", h + "mlp.c_fc.weight", Layout::Transposed, {D, F});
    add(w + "mlp.fc1.bias", h + "mlp.c_fc.bias", Layout::Same, {F});
    add(w + "mlp.fc2.weight", h + "mlp.c_proj.weight", Layout::Transposed, {F, D});
    add(w + "mlp.fc2.bias", h + "mlp.c_proj.bias", Layout::Same, {D});
  }
  add("norm.weight", "transformer.ln_f.weight", Layout::Same, {D});
  add("norm.bias", "transformer.ln_f.bias", Layout::Same, {D});
  return m;
}

// The causal-mask buffers older GPT-2 files hold, and a copy of the head (tied: the embedding).
bool gpt2_ignorable(const std::string& tensor, const data::hf::ModelConfig&) {
  return tensor.ends_with(".attn.bias") || tensor.ends_with(".attn.masked_bias") ||
         tensor == "lm_head.weight";
}

}  // namespace

namespace detail {

data::hf::ArchitectureSpec gpt2_architecture() {
  return {.name = "gpt2",
          .display = "GPT-2",
          .model_types = {"gpt2"},
          .read = read_gpt2,
          .write = write_gpt2,
          .mappings = gpt2_mappings,
          .ignorable = gpt2_ignorable};
}

}  // namespace detail

GPT2Options gpt2_options(const data::hf::ModelConfig& config, Generator* generator) {
  WEAVE_CHECK(config.architecture == "gpt2", kGPT2Hf,
              "gpt2_options needs a GPT-2 configuration, found Llama's");
  return {.vocab = config.vocab,
          .dim = config.dim,
          .layers = config.layers,
          .heads = config.heads,
          .max_positions = config.max_positions,
          .generator = generator};
}

data::hf::ModelConfig model_config(const GPT2Options& options, DType dtype) {
  WEAVE_CHECK(!options.untied_head && options.tanh_gelu, kGPT2Hf,
              "Hugging Face's GPT-2 ties its head to the token embedding and uses the tanh GELU; "
              "found untied_head {}, tanh_gelu {}",
              options.untied_head, options.tanh_gelu);
  data::hf::ModelConfig config;
  config.architecture = "gpt2";
  config.vocab = options.vocab, config.dim = options.dim, config.layers = options.layers;
  config.heads = options.heads, config.kv_heads = options.heads;
  config.hidden = 4 * options.dim, config.max_positions = options.max_positions;
  config.tie_embeddings = true, config.dtype = dtype;
  return config;
}

}  // namespace weave::models

// The experts of Llama-class mixture-of-experts checkpoints (MixtralForCausalLM, model_type
// mixtral: every block's MLP is block_sparse_moe, top-k of num_local_experts SwiGLU experts
// w1/w3/w2, gates renormalized; Qwen3MoeForCausalLM, model_type qwen3_moe: Qwen 3 with every
// block's MLP top-k of num_experts experts gate_proj/up_proj/down_proj of moe_intermediate_size,
// renormalized where norm_topk_prob says): config.json's fields and the tensors' names, for
// llama_hf.cpp. weave's router is nn::TopKRouter (softmax over every expert, then the top k) and
// each expert an nn::GatedMLP.
#include <nlohmann/json.hpp>

#include "weave/models/architectures.h"

namespace weave::models::detail {

namespace {

using json = nlohmann::json;
using data::hf::config_integer;
using data::hf::detail::Layout;
using data::hf::detail::Mapping;
constexpr const char* kMoeHf = "hf";

}  // namespace

bool has_experts(const std::string& model_type) {
  return model_type == "mixtral" || model_type == "qwen3_moe" || model_type == "qwen2_moe";
}

namespace {
// Mixtral's names (block_sparse_moe, w1/w3/w2) where neither Qwen's biases nor its norms say Qwen.
bool mixtral_names(const data::hf::ModelConfig& c) {
  return !c.qk_norm && !c.qkv_bias;
}
}  // namespace

void read_experts(const json& c, const std::string& path, data::hf::ModelConfig& config) {
  const std::string& type = config.model_type;
  if (!has_experts(type)) return;
  const bool mixtral = type == "mixtral";
  config.experts = config_integer(c, mixtral ? "num_local_experts" : "num_experts", path);
  config.experts_per_token = config_integer(c, "num_experts_per_tok", path);
  config.expert_hidden = mixtral ? config.hidden : config_integer(c, "moe_intermediate_size", path);
  config.norm_topk_prob = mixtral || c.value("norm_topk_prob", false);
  config.router_aux_loss_coef = c.value("router_aux_loss_coef", 0.001);
  if (type == "qwen2_moe")
    config.shared_expert_hidden = config_integer(c, "shared_expert_intermediate_size", path);
  WEAVE_CHECK(config.experts >= 1 && config.experts <= 4096 && config.experts_per_token >= 1 &&
                  config.experts_per_token <= config.experts && config.expert_hidden >= 1 &&
                  config.expert_hidden <= (int64_t(1) << 20),
              kMoeHf,
              "{}: {} experts, {} a token (num_experts_per_tok) of width {}: expected 1 to 4096 "
              "experts, 1 to all of them a token and a width of 1 to 2^20",
              path, config.experts, config.experts_per_token, config.expert_hidden);
  const auto unsupported = [&](bool bad, const std::string& what) {
    WEAVE_CHECK(!bad, kMoeHf, "{}: {} is not supported", path, what);
  };
  unsupported(c.value("router_jitter_noise", 0.0) != 0.0,
              "router_jitter_noise " + c.value("router_jitter_noise", json(0.0)).dump());
  if (mixtral) return;
  unsupported(c.value("decoder_sparse_step", int64_t(1)) != 1,
              "decoder_sparse_step " + c.value("decoder_sparse_step", json(1)).dump() +
                  " (weave's blocks are all experts or none)");
  const json dense = c.value("mlp_only_layers", json::array());
  unsupported(!dense.is_array() || !dense.empty(),
              "mlp_only_layers " + dense.dump() + " (weave's blocks are all experts or none)");
}

void write_experts(const data::hf::ModelConfig& config, json& c) {
  if (config.experts == 0) return;
  const bool mixtral = mixtral_names(config);
  c[mixtral ? "num_local_experts" : "num_experts"] = config.experts;
  c["num_experts_per_tok"] = config.experts_per_token;
  c["router_aux_loss_coef"] = config.router_aux_loss_coef;
  if (mixtral) {
    c["intermediate_size"] = config.expert_hidden, c["router_jitter_noise"] = 0.0;
    return;
  }
  c["moe_intermediate_size"] = config.expert_hidden, c["norm_topk_prob"] = config.norm_topk_prob;
  c["decoder_sparse_step"] = 1, c["mlp_only_layers"] = json::array();
  if (config.qkv_bias) c["shared_expert_intermediate_size"] = config.shared_expert_hidden;
}

void add_expert_mappings(const data::hf::ModelConfig& c, const std::string& weave,
                         const std::string& hf, std::vector<Mapping>& m) {
  const bool mixtral = mixtral_names(c);
  const int64_t D = c.dim, F = c.expert_hidden, S = c.shared_expert_hidden;
  const std::string block = hf + (mixtral ? "block_sparse_moe." : "mlp.");
  m.push_back(
      {weave + "moe.router.gate.weight", {block + "gate.weight"}, Layout::Same, {{c.experts, D}}});
  for (int64_t j = 0; j < c.experts; ++j) {
    const std::string w = weave + "moe.expert" + std::to_string(j) + ".";
    const std::string h = block + "experts." + std::to_string(j) + ".";
    m.push_back({w + "gate_up",
                 {h + (mixtral ? "w1.weight" : "gate_proj.weight"),
                  h + (mixtral ? "w3.weight" : "up_proj.weight")},
                 Layout::Stacked,
                 {{F, D}, {F, D}}});
    m.push_back({w + "down.weight",
                 {h + (mixtral ? "w2.weight" : "down_proj.weight")},
                 Layout::Same,
                 {{D, F}}});
  }
  if (S == 0) return;
  m.push_back({weave + "moe.shared.gate_up",
               {block + "shared_expert.gate_proj.weight", block + "shared_expert.up_proj.weight"},
               Layout::Stacked,
               {{S, D}, {S, D}}});
  m.push_back({weave + "moe.shared.down.weight",
               {block + "shared_expert.down_proj.weight"},
               Layout::Same,
               {{D, S}}});
  m.push_back({weave + "moe.shared_gate.weight",
               {block + "shared_expert_gate.weight"},
               Layout::Same,
               {{1, D}}});
}

std::optional<nn::MoEOptions> experts_of(const data::hf::ModelConfig& config) {
  if (config.experts == 0) return std::nullopt;
  return nn::MoEOptions{.hidden = config.dim,
                        .ffn = config.expert_hidden,
                        .router = {.experts = config.experts,
                                   .top_k = config.experts_per_token,
                                   .renormalize = config.norm_topk_prob,
                                   .aux_loss_coef = config.router_aux_loss_coef},
                        .gated = true,
                        .shared_ffn = config.shared_expert_hidden,
                        .shared_gate = config.shared_expert_hidden > 0};
}

void set_experts(const std::optional<nn::MoEOptions>& moe, data::hf::ModelConfig& config) {
  if (!moe) return;
  const nn::RouterOptions& router = moe->router;
  WEAVE_CHECK(moe->gated && router.gate == nn::Gate::Softmax && router.capacity_factor == 0 &&
                  router.z_loss_coef == 0,
              kMoeHf,
              "Hugging Face's Mixtral and Qwen 3 MoE take SwiGLU experts under a softmax router "
              "without capacity limit or z-loss; found gated {}, sigmoid gates {}, "
              "capacity_factor {}, z_loss_coef {}",
              moe->gated, router.gate == nn::Gate::Sigmoid, router.capacity_factor,
              router.z_loss_coef);
  config.experts = router.experts, config.experts_per_token = router.top_k;
  config.expert_hidden = moe->ffn, config.norm_topk_prob = router.renormalize || router.top_k == 1;
  config.router_aux_loss_coef = router.aux_loss_coef;
  config.shared_expert_hidden = moe->shared_ffn;
  WEAVE_CHECK(!mixtral_names(config) || config.norm_topk_prob, kMoeHf,
              "Hugging Face's Mixtral renormalizes the chosen experts' gates; found renormalize "
              "false (the Qwen MoEs' norm_topk_prob false takes their q/k norms or biases)");
  WEAVE_CHECK(moe->shared_ffn == 0 || (config.qkv_bias && moe->shared_gate), kMoeHf,
              "Hugging Face's shared expert is Qwen 2 MoE's: gated, with q/k/v biases; found "
              "shared_gate {}, qkv_bias {}",
              moe->shared_gate, config.qkv_bias);
}

}  // namespace weave::models::detail

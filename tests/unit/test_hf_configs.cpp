// Every config.json field weave reads from a GPT-2, Llama or Qwen 2 checkpoint (tests/data/hf),
// set to a value other than the reference's: a field weave does not implement raises at load,
// naming the field; one it implements changes the model as it says; one that changes nothing
// in the forward (dropouts, initialization, caching, the "default" rope) leaves the logits
// bitwise as they were; a size that disagrees with the weights raises.
#include <filesystem>
#include <nlohmann/json.hpp>

#include "helpers.h"
#include "hf_helpers.h"

using namespace weave;
using namespace weave_test;
using nlohmann::json;

namespace {

struct FieldCase {
  const char* field;
  json value;
  // "refused: <part of the message>" (a setting: the message names the field), "mismatch:
  // <part>" (a size the weights contradict), "same logits", "changes logits".
  const char* outcome;
};

// The reference checkpoint of `arch` with one config field set, loaded: its logits on the
// reference tokens, or the error it raised.
std::pair<Tensor, std::string> logits_with(const std::string& arch, const char* field,
                                           const json& value) {
  const auto dir = scratch(std::string("field_") + arch);
  copy_checkpoint(reference_dir(arch), dir);
  edit_config(dir, [&](json& c) {
    if (value.is_null())
      c.erase(field);
    else
      c[field] = value;
  });
  try {
    auto model = models::from_pretrained(dir.string());
    Tensor tokens;
    for (const auto& [name, t] :
         data::load_safetensors((dir / "logits.safetensors").string()).tensors)
      if (name == "tokens") tokens = t;
    NoGradGuard no_grad;
    return {(*model)(tokens), ""};
  } catch (const Error& e) {
    return {Tensor(), e.what()};
  }
}

void check_fields(const std::string& arch, const std::vector<FieldCase>& cases) {
  const Tensor reference = logits_with(arch, "_unused_by_any_reader", json(0)).first;
  REQUIRE(reference.defined());
  for (const FieldCase& c : cases) {
    const std::string field = c.field, outcome = c.outcome, value = c.value.dump();
    CAPTURE(arch);
    CAPTURE(field);
    CAPTURE(value);
    const auto loaded = logits_with(arch, c.field, c.value);
    const Tensor& logits = loaded.first;
    const std::string& error = loaded.second;
    if (outcome.starts_with("refused: ") || outcome.starts_with("mismatch: ")) {
      CHECK(!logits.defined());
      CHECK(error.find(outcome.substr(outcome.find(": ") + 2)) != std::string::npos);
      if (outcome.starts_with("refused: ")) CHECK(error.find(field) != std::string::npos);
    } else {
      REQUIRE_MESSAGE(logits.defined(), error);
      CHECK(equal(logits, reference) == (outcome == "same logits"));
    }
  }
}

}  // namespace

TEST_SUITE("hf_checkpoint") {
  TEST_CASE("every GPT-2 config field weave reads is honoured or refused") {
    check_fields("gpt2",
                 {{"scale_attn_weights", false, "refused: scale_attn_weights false"},
                  {"scale_attn_by_inverse_layer_idx", true, "refused: is not supported"},
                  {"reorder_and_upcast_attn", true, "refused: is not supported"},
                  {"add_cross_attention", true, "refused: is not supported"},
                  {"activation_function", "relu", "refused: is not supported"},
                  {"n_inner", 128, "refused: n_inner = 4 n_embd"},
                  {"layer_norm_epsilon", 1e-3, "refused: layer_norm_epsilon 1e-5"},
                  {"tie_word_embeddings", false, "refused: tie_word_embeddings"},
                  {"n_layer", 1, "mismatch: does not use"},
                  {"n_layer", 1000000000, "mismatch: the layer count is 1000000000, outside"},
                  {"n_embd", 32, "mismatch: has shape"},
                  {"n_positions", 64, "mismatch: has shape"},
                  {"vocab_size", 256, "mismatch: has shape"},
                  {"scale_attn_weights", true, "same logits"},
                  {"scale_attn_by_inverse_layer_idx", false, "same logits"},
                  {"activation_function", "gelu_pytorch_tanh", "same logits"},
                  {"n_inner", nullptr, "same logits"},  // absent: 4 n_embd
                  {"resid_pdrop", 0.3, "same logits"},  // dropouts: training only
                  {"embd_pdrop", 0.3, "same logits"},
                  {"attn_pdrop", 0.3, "same logits"},
                  {"initializer_range", 0.5, "same logits"},
                  {"use_cache", false, "same logits"},
                  {"n_head", 2, "changes logits"}});
  }

  TEST_CASE(
      "every Llama, Qwen 2, Qwen 3 and Mistral config field weave reads is honoured or refused") {
    const std::vector<FieldCase> shared{
        {"attention_bias", true, "refused: attention_bias true"},
        {"mlp_bias", true, "refused: mlp_bias true"},
        {"hidden_act", "gelu", "refused: hidden_act 'gelu'"},
        {"head_dim", 8, "mismatch: has shape"},
        {"attention_dropout", 0.1, "refused: attention_dropout 0.1"},
        {"rope_scaling", {{"rope_type", "linear"}, {"factor", 2.0}}, "refused: rope_scaling"},
        {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 2.0}}, "refused: rope_scaling"},
        {"num_hidden_layers", 1, "mismatch: does not use"},
        {"num_hidden_layers", int64_t(1) << 40, "mismatch: the layer count is"},
        {"vocab_size", int64_t(1) << 31, "mismatch: the vocabulary is"},
        {"hidden_size", 32, "mismatch: has shape"},
        {"intermediate_size", 160, "mismatch: has shape"},
        {"num_key_value_heads", 4, "mismatch: has shape"},
        {"vocab_size", 256, "mismatch: has shape"},
        {"attention_dropout", 0.0, "same logits"},
        {"pretraining_tp", 1, "same logits"},
        {"initializer_range", 0.5, "same logits"},
        {"use_cache", false, "same logits"},
        {"max_position_embeddings", 4096, "same logits"},  // rotary needs no table
        {"rope_theta", 1000.0, "changes logits"},
        {"rms_norm_eps", 1e-2, "changes logits"},
        {"num_attention_heads", 8, "mismatch: has shape"},
        {"tie_word_embeddings", true, "changes logits"}};  // lm_head passed over
    check_fields("llama", shared);
    check_fields("llama", {{"sliding_window", 16, "refused: sliding_window"},
                           {"head_dim", 16, "same logits"}});  // hidden_size / heads, said
    const std::vector<FieldCase> qwen{
        {"sliding_window", 16, "same logits"},  // unused without the flag
        {"max_window_layers", 1, "same logits"},
        {"layer_types", {"sliding_attention", "sliding_attention"}, "same logits"}};
    check_fields("qwen2", shared);
    check_fields("qwen2", qwen);
    check_fields("qwen2", {{"head_dim", 16, "same logits"},
                           // windows from max_window_layers (2: none) on; 4096 covers 24 tokens
                           {"use_sliding_window", true, "same logits"}});
    check_fields("qwen3", shared);  // its head_dim (32) is twice hidden_size / heads
    check_fields("qwen3", qwen);
    check_fields("qwen3", {{"use_sliding_window", true, "mismatch: no integer 'sliding_window'"}});
    check_fields("mistral", shared);  // its head_dim (32) is twice hidden_size / heads
    check_fields("mistral",
                 {{"sliding_window", nullptr, "changes logits"},  // no window
                  {"sliding_window", 24, "changes logits"},
                  {"sliding_window", 0, "refused: sliding_window 0 must be positive"},
                  {"sliding_window", "5", "mismatch: no integer 'sliding_window'"},
                  {"layer_types", {"sliding_attention", "sliding_attention"}, "same logits"},
                  {"layer_types",
                   {"full_attention", "sliding_attention"},
                   "refused: full_attention layers is not supported"},
                  {"layer_types", {"sliding_attention"}, "refused: one type for"},
                  {"model_type", "llama", "refused: sliding_window is not supported"}});
    check_fields("qwen3", {{"head_dim", 16, "mismatch: has shape"},
                           {"head_dim", nullptr, "mismatch: has shape"},  // 128, as HF's
                           {"model_type", "qwen2", "mismatch: lacks 6 tensor(s)"}});
  }

  TEST_CASE("every Gemma 2 and Gemma 3 config field weave reads is honoured or refused") {
    const std::vector<FieldCase> shared{
        {"hidden_activation", "gelu", "refused: hidden_activation 'gelu'"},
        {"attention_bias", true, "refused: attention_bias true"},
        {"attention_dropout", 0.1, "refused: attention_dropout 0.1"},
        {"head_dim", 16, "mismatch: has shape"},
        {"head_dim", nullptr, "mismatch: has shape"},  // 256, as Hugging Face's
        {"query_pre_attn_scalar", 100, "changes logits"},
        {"query_pre_attn_scalar", nullptr, "changes logits"},  // 256
        {"query_pre_attn_scalar", 0, "refused: query_pre_attn_scalar must be positive"},
        {"sliding_window", 24, "changes logits"},
        {"sliding_window", nullptr, "refused: local layers need a sliding_window"},
        {"layer_types", {"sliding_attention"}, "refused: one type for"},
        {"rms_norm_eps", 1e-2, "changes logits"},
        {"rope_theta", 1000.0, "changes logits"},
        {"tie_word_embeddings", false, "mismatch: lacks 1 tensor(s)"},  // no lm_head of its own
        {"num_hidden_layers", 1, "mismatch: does not use"},
        {"initializer_range", 0.5, "same logits"},
        {"use_cache", false, "same logits"},
        {"cache_implementation", "hybrid", "same logits"},
        {"max_position_embeddings", 4096, "same logits"},
        {"hidden_activation", "gelu_pytorch_tanh", "same logits"}};
    check_fields("gemma2", shared);
    check_fields(
        "gemma2",
        {{"attn_logit_softcapping", nullptr, "changes logits"},
         {"final_logit_softcapping", nullptr, "changes logits"},
         {"attn_logit_softcapping", -1, "refused: attn_logit_softcapping must be"},
         {"final_logit_softcapping", "30", "refused: final_logit_softcapping must be"},
         {"layer_types", {"full_attention", "full_attention"}, "changes logits"},
         {"layer_types", {"sliding_attention", "full_attention"}, "same logits"},
         {"rope_scaling", {{"rope_type", "linear"}, {"factor", 2.0}}, "refused: rope_scaling"}});
    check_fields("gemma3", shared);
    check_fields(
        "gemma3",
        {{"rope_local_base_freq", 500.0, "changes logits"},
         {"rope_scaling", nullptr, "changes logits"},
         {"rope_scaling", {{"rope_type", "default"}}, "changes logits"},
         {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 2.0}}, "refused: rope_scaling"},
         {"sliding_window_pattern", 2, "changes logits"},
         {"sliding_window_pattern", 3, "same logits"},
         {"layer_types",
          {"sliding_attention", "sliding_attention", "full_attention"},
          "same logits"},
         {"attn_logit_softcapping", 50.0, "changes logits"},
         {"use_bidirectional_attention", true, "refused: use_bidirectional_attention true"}});
  }

  TEST_CASE(
      "every Mixtral, Qwen 3 MoE and Qwen 2 MoE config field weave reads is honoured or refused") {
    check_fields("mixtral", {{"num_experts_per_tok", 1, "changes logits"},
                             {"num_experts_per_tok", 5, "refused: num_experts_per_tok"},
                             {"num_local_experts", 2, "mismatch: does not use"},
                             {"intermediate_size", 64, "mismatch: has shape"},
                             {"router_jitter_noise", 0.1, "refused: router_jitter_noise 0.1"},
                             {"router_aux_loss_coef", 0.5, "same logits"},  // training only
                             {"output_router_logits", true, "same logits"},
                             {"sliding_window", 3, "changes logits"},
                             {"hidden_act", "gelu", "refused: hidden_act 'gelu'"}});
    check_fields("qwen3_moe", {{"norm_topk_prob", false, "changes logits"},
                               {"num_experts_per_tok", 2, "changes logits"},
                               {"num_experts", 4, "mismatch: does not use"},
                               {"moe_intermediate_size", 32, "mismatch: has shape"},
                               {"intermediate_size", 64, "same logits"},  // its dense layers'
                               {"decoder_sparse_step", 2, "refused: decoder_sparse_step 2"},
                               {"mlp_only_layers", {0}, "refused: mlp_only_layers [0]"},
                               {"mlp_only_layers", json::array(), "same logits"},
                               {"router_aux_loss_coef", 0.5, "same logits"}});
    check_fields("qwen2_moe", {{"norm_topk_prob", true, "changes logits"},
                               {"shared_expert_intermediate_size", 64, "mismatch: has shape"},
                               {"shared_expert_intermediate_size", nullptr,
                                "mismatch: no integer 'shared_expert_intermediate_size'"},
                               {"decoder_sparse_step", 2, "refused: decoder_sparse_step 2"}});
  }

  TEST_CASE("rope_scaling with rope_type default loads as no scaling") {
    for (const std::string arch : {"llama", "qwen2", "qwen3"}) {
      CAPTURE(arch);
      const Tensor none = logits_with(arch, "rope_scaling", nullptr).first;
      const Tensor by_default = logits_with(arch, "rope_scaling", {{"rope_type", "default"}}).first;
      const Tensor legacy = logits_with(arch, "rope_scaling", {{"type", "default"}}).first;
      REQUIRE(none.defined());
      REQUIRE(by_default.defined());
      CHECK(equal(by_default, none));
      CHECK(equal(legacy, none));
    }
  }
}

// Llama's options from a Hugging Face configuration, and back.
#include "weave/models/llama/llama.h"

namespace weave::models {

LlamaOptions llama_options(const data::hf::ModelConfig& config, Generator* generator) {
  WEAVE_CHECK(config.architecture == data::hf::Architecture::Llama, "hf",
              "llama_options needs a Llama configuration, found GPT-2's");
  const RotaryOptions rotary{.base = config.rope_theta, .llama3_scaling = config.rope_scaling};
  return {.vocab = config.vocab,
          .dim = config.dim,
          .layers = config.layers,
          .block = {.heads = config.heads,
                    .kv_heads = config.kv_heads,
                    .hidden = config.hidden,
                    .rotary = rotary,
                    .norm_eps = config.norm_eps,
                    .qkv_bias = config.qkv_bias},
          .tie_embeddings = config.tie_embeddings,
          .generator = generator};
}

data::hf::ModelConfig model_config(const LlamaOptions& options, DType dtype) {
  const LlamaBlockOptions& block = options.block;
  const RotaryOptions rotary = block.rotary.value_or(RotaryOptions{});
  WEAVE_CHECK(block.rotary && !rotary.interleaved && rotary.rotary_dim == 0 && block.causal &&
                  block.activation == nn::GatedActivation::SiLU,
              "hf",
              "Hugging Face's Llama takes causal blocks with SwiGLU and rotary positions in the "
              "rotate-half layout over whole heads; found rotary {}, interleaved {}, rotary_dim "
              "{}, causal {}, SwiGLU {}",
              block.rotary.has_value(), rotary.interleaved, rotary.rotary_dim, block.causal,
              block.activation == nn::GatedActivation::SiLU);
  data::hf::ModelConfig config;
  config.architecture = data::hf::Architecture::Llama;
  config.vocab = options.vocab, config.dim = options.dim, config.layers = options.layers;
  config.heads = block.heads, config.kv_heads = block.kv_heads > 0 ? block.kv_heads : block.heads;
  config.hidden = block.hidden > 0 ? block.hidden : llama_hidden(options.dim);
  config.norm_eps = block.norm_eps, config.rope_theta = rotary.base;
  config.rope_scaling = rotary.llama3_scaling, config.tie_embeddings = options.tie_embeddings;
  config.qkv_bias = block.qkv_bias, config.dtype = dtype;
  return config;
}

}  // namespace weave::models

#include "weave/nn/transformer.h"

#include "weave/autograd/grad_mode.h"

namespace weave::nn {

KVCache::KVCache(int64_t max_length) : max_length_(max_length) {
  WEAVE_CHECK(max_length > 0, "KVCache", "max_length must be positive, found {}", max_length);
}

std::pair<Tensor, Tensor> KVCache::append(const Tensor& k, const Tensor& v) {
  WEAVE_CHECK(k.dim() == 4 && v.dim() == 4 && k.size(2) == v.size(2), "KVCache",
              "expected k and v [B, H, T, D] of one length, found {} and {}", k.shape(), v.shape());
  if (keys_.defined()) {
    const bool same = k.size(0) == keys_.size(0) && k.size(1) == keys_.size(1) &&
                      k.size(3) == keys_.size(3) && v.size(3) == values_.size(3) &&
                      k.dtype() == keys_.dtype() && k.device() == keys_.device();
    WEAVE_CHECK(same, "KVCache",
                "expected keys like the cached ones [{}, {}, *, {}] ({}), found {} ({}); hint: "
                "reset() only rewinds, a different batch needs its own cache",
                keys_.size(0), keys_.size(1), keys_.size(3), keys_.dtype(), k.shape(), k.dtype());
  }
  WEAVE_CHECK(length_ + k.size(2) <= max_length_, "KVCache",
              "{} cached positions + {} new exceed max_length {}", length_, k.size(2), max_length_);
  NoGradGuard no_grad;
  if (!keys_.defined()) {
    keys_ = empty({k.size(0), k.size(1), max_length_, k.size(3)},
                  {.dtype = k.dtype(), .device = k.device()});
    values_ = empty({v.size(0), v.size(1), max_length_, v.size(3)},
                    {.dtype = v.dtype(), .device = v.device()});
  }
  keys_.narrow(2, length_, k.size(2)).copy_(k);
  values_.narrow(2, length_, v.size(2)).copy_(v);
  length_ += k.size(2);
  return {keys_.narrow(2, 0, length_), values_.narrow(2, 0, length_)};
}

namespace {

/// qkv [B, T, heads * 3 * head_dim] as [B, T, H, 3, hd] (checked): q, k and v are
/// [B, H, T, hd] views of it.
Tensor packed_heads(const Tensor& qkv, int64_t heads) {
  WEAVE_CHECK(qkv.dim() == 3 && heads > 0 && qkv.size(2) % (3 * heads) == 0, "fused_qkv_attention",
              "expected qkv [B, T, heads * 3 * head_dim] with {} heads, found {}", heads,
              qkv.shape());
  return qkv.reshape({qkv.size(0), qkv.size(1), heads, 3, qkv.size(2) / (3 * heads)});
}

/// Attention's [B, H, T, hd] output as [B, T, H * hd] (a view: it is stored heads-last).
Tensor merge_heads(const Tensor& y) {
  return y.transpose(1, 2).reshape({y.size(0), y.size(2), y.size(1) * y.size(3)});
}

}  // namespace

Tensor fused_qkv_attention(const Tensor& qkv, int64_t heads, const AttentionOptions& options,
                           KVCache* cache) {
  // Without a cache, one attention node over the packed projection: one gradient buffer.
  if (!cache) return merge_heads(packed_qkv_attention(packed_heads(qkv, heads), options));
  return fused_qkv_attention(qkv, heads, [&](const Tensor& q, Tensor k, Tensor v) {
    std::tie(k, v) = cache->append(k, v);
    return scaled_dot_product_attention(q, k, v, options);
  });
}

Tensor fused_qkv_attention(
    const Tensor& qkv, int64_t heads,
    const std::function<Tensor(const Tensor& q, const Tensor& k, const Tensor& v)>& attend) {
  Tensor projected = packed_heads(qkv, heads);
  Tensor q = projected.select(3, 0).transpose(1, 2);
  Tensor k = projected.select(3, 1).transpose(1, 2);
  Tensor v = projected.select(3, 2).transpose(1, 2);
  return merge_heads(attend(q, k, v));
}

MultiheadAttention::MultiheadAttention(int64_t dim, int64_t heads,
                                       MultiheadAttentionOptions options)
    : Module("MultiheadAttention"), dim_(dim), heads_(heads), options_(options) {
  WEAVE_CHECK(heads > 0 && dim > 0 && dim % heads == 0, "MultiheadAttention",
              "dim {} must be a positive multiple of heads {}", dim, heads);
  qkv = register_module("qkv",
                        std::make_shared<Linear>(dim, 3 * dim, options.bias, options.generator));
  out = register_module("out", std::make_shared<Linear>(dim, dim, options.bias, options.generator));
}

Tensor MultiheadAttention::forward(const Tensor& x) {
  return attend(x, nullptr);
}

Tensor MultiheadAttention::forward(const Tensor& x, KVCache& cache) {
  return attend(x, &cache);
}

Tensor MultiheadAttention::attend(const Tensor& x, KVCache* cache) {
  WEAVE_CHECK(x.dim() == 3 && x.size(2) == dim_, "MultiheadAttention",
              "expected input [B, T, {}], found {}", dim_, x.shape());
  const double p = is_training() ? options_.dropout : 0.0;
  Tensor y = fused_qkv_attention(
      (*qkv)(x), heads_,
      {.causal = options_.causal, .dropout_p = p, .generator = options_.generator}, cache);
  return (*out)(y);
}

MLP::MLP(int64_t dim, int64_t hidden, MLPOptions options)
    : Module("MLP"), tanh_gelu_(options.tanh_gelu) {
  fc1 = register_module("fc1",
                        std::make_shared<Linear>(dim, hidden, options.bias, options.generator));
  fc2 = register_module("fc2",
                        std::make_shared<Linear>(hidden, dim, options.bias, options.generator));
}

Tensor MLP::forward(const Tensor& x) {
  return (*fc2)(bias_gelu(linear(x, fc1->weight), fc1->bias, tanh_gelu_));
}

Tensor gated_activation(const Tensor& gate_up, GatedActivation activation) {
  switch (activation) {
    case GatedActivation::SiLU:
      return swiglu(gate_up);
    case GatedActivation::GELU:
      return geglu(gate_up);
    case GatedActivation::GELUTanh:
      return geglu(gate_up, true);
  }
  WEAVE_FAIL("gated_activation", "unknown activation {}", int(activation));
}

GatedMLP::GatedMLP(int64_t dim, int64_t hidden, GatedMLPOptions options)
    : Module("GatedMLP"),
      gate_up(register_parameter("gate_up", Tensor())),
      gate_up_bias(register_parameter("gate_up_bias", Tensor())),
      activation_(options.activation) {
  StackedProjection projection = stacked_projection(dim, hidden, options.bias, options.generator);
  gate_up = projection.weight;
  gate_up_bias = projection.bias;
  down = register_module("down",
                         std::make_shared<Linear>(hidden, dim, options.bias, options.generator));
}

Tensor GatedMLP::forward(const Tensor& x) {
  return (*down)(gated_activation(apply_stacked(x, gate_up, gate_up_bias), activation_));
}

TransformerBlock::TransformerBlock(int64_t dim, int64_t heads, TransformerBlockOptions options)
    : Module("TransformerBlock") {
  norm1 = register_module("norm1", std::make_shared<LayerNorm>(Shape{dim}));
  attention =
      register_module("attention", std::make_shared<MultiheadAttention>(
                                       dim, heads,
                                       MultiheadAttentionOptions{.bias = options.bias,
                                                                 .causal = options.causal,
                                                                 .dropout = options.dropout,
                                                                 .generator = options.generator}));
  norm2 = register_module("norm2", std::make_shared<LayerNorm>(Shape{dim}));
  mlp = register_module("mlp",
                        std::make_shared<MLP>(dim, options.hidden > 0 ? options.hidden : 4 * dim,
                                              MLPOptions{.bias = options.bias,
                                                         .tanh_gelu = options.tanh_gelu,
                                                         .generator = options.generator}));
  dropout_ =
      register_module("dropout", std::make_shared<Dropout>(options.dropout, options.generator));
}

Tensor TransformerBlock::forward(const Tensor& x) {
  return run(x, nullptr);
}

Tensor TransformerBlock::forward(const Tensor& x, KVCache& cache) {
  return run(x, &cache);
}

Tensor TransformerBlock::run(const Tensor& x, KVCache* cache) {
  Tensor normed = (*norm1)(x);
  Tensor h = x + (*dropout_)(cache ? attention->forward(normed, *cache) : (*attention)(normed));
  return h + (*dropout_)((*mlp)((*norm2)(h)));
}

}  // namespace weave::nn

#include "weave/nn/transformer.h"

#include "weave/autograd/grad_mode.h"

namespace weave::nn {

KVCache::KVCache(int64_t max_length) : max_length_(max_length) {
  WEAVE_CHECK(max_length > 0, "KVCache", "max_length must be positive, found {}", max_length);
}

std::pair<Tensor, Tensor> KVCache::append(const Tensor& k, const Tensor& v, int64_t window) {
  WEAVE_CHECK(k.dim() == 4 && v.dim() == 4 && k.size(2) == v.size(2), "KVCache",
              "expected k and v [B, H, T, D] of one length, found {} and {}", k.shape(), v.shape());
  WEAVE_CHECK(window >= 0 && (window_ < 0 || window == window_), "KVCache",
              "appended with window {} after window {}; hint: one cache a layer, and a layer "
              "keeps its window",
              window, window_);
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
  window_ = window;
  NoGradGuard no_grad;
  if (window > 0) return append_windowed(k, v);
  if (!keys_.defined()) {
    keys_ = empty({k.size(0), k.size(1), max_length_, k.size(3)},
                  {.dtype = k.dtype(), .device = k.device()});
    values_ = empty({v.size(0), v.size(1), max_length_, v.size(3)},
                    {.dtype = v.dtype(), .device = v.device()});
  }
  keys_.narrow(2, length_, k.size(2)).copy_(k);
  values_.narrow(2, length_, v.size(2)).copy_(v);
  length_ += k.size(2);
  held_ = length_;
  return {keys_.narrow(2, 0, length_), values_.narrow(2, 0, length_)};
}

// The window - 1 latest positions are all a later query can reach: the call attends to them
// and its own, then keeps the latest window - 1 of both.
std::pair<Tensor, Tensor> KVCache::append_windowed(const Tensor& k, const Tensor& v) {
  const int64_t keep = std::min(window_ - 1, max_length_);
  if (!keys_.defined()) {
    keys_ =
        empty({k.size(0), k.size(1), keep, k.size(3)}, {.dtype = k.dtype(), .device = k.device()});
    values_ =
        empty({v.size(0), v.size(1), keep, v.size(3)}, {.dtype = v.dtype(), .device = v.device()});
  }
  const Tensor keys = cat({keys_.narrow(2, 0, held_), k}, 2);
  const Tensor values = cat({values_.narrow(2, 0, held_), v}, 2);
  held_ = std::min(keep, keys.size(2));
  keys_.narrow(2, 0, held_).copy_(keys.narrow(2, keys.size(2) - held_, held_));
  values_.narrow(2, 0, held_).copy_(values.narrow(2, values.size(2) - held_, held_));
  length_ += k.size(2);
  return {keys, values};
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
                                       MultiheadAttentionOptions options, Leaves leaves)
    : CachedModule("MultiheadAttention"),
      dim_(dim),
      heads_(heads),
      local_heads_(0),
      options_(options),
      leaves_(std::move(leaves)) {
  WEAVE_CHECK(heads > 0 && dim > 0 && dim % heads == 0, "MultiheadAttention",
              "dim {} must be a positive multiple of heads {}", dim, heads);
  const Linears& linears = leaves_.linear();
  WEAVE_CHECK(heads % linears.parts() == 0, "MultiheadAttention",
              "{} heads do not divide among {} ranks; hint: use a tensor-parallel size that "
              "divides the number of heads",
              heads, linears.parts());
  leaves_.core().check("MultiheadAttention", /*decoding=*/false, options.dropout > 0);
  local_heads_ = heads / linears.parts();
  qkv = register_module("qkv", linears.column(dim, 3 * dim, options.bias, options.generator));
  out = register_module("out", linears.row(dim, dim, options.bias, options.generator));
  leaves_.core().place(*this);
}

Tensor MultiheadAttention::forward(const Tensor& x) {
  return attend(x, nullptr);
}

Tensor MultiheadAttention::forward(const Inputs& inputs, KVCache& cache) {
  leaves_.linear().check_decoding("MultiheadAttention");
  leaves_.core().check("MultiheadAttention", /*decoding=*/true, false);
  return attend(inputs.x, &cache);
}

Tensor MultiheadAttention::attend(const Tensor& x, KVCache* cache) {
  WEAVE_CHECK(x.dim() == 3 && x.size(2) == dim_, "MultiheadAttention",
              "expected input [B, T, {}], found {}", dim_, x.shape());
  const AttentionOptions options{.causal = options_.causal,
                                 .dropout_p = is_training() ? options_.dropout : 0.0,
                                 .generator = options_.generator};
  const CoreAttention& core = leaves_.core();
  // The whole process's core attention takes the packed projection as one node.
  const bool whole = leaves_.attention == nullptr;
  Tensor y = whole ? fused_qkv_attention((*qkv)(x), local_heads_, options, cache)
                   : fused_qkv_attention((*qkv)(x), local_heads_,
                                         [&](const Tensor& q, Tensor k, Tensor v) {
                                           if (cache) std::tie(k, v) = cache->append(k, v);
                                           return core.attend(q, k, v, options);
                                         });
  return (*out)(y);
}

void MultiheadAttention::adapt(const std::string& name, const AdapterSpec& spec) {
  WEAVE_CHECK(name == "qkv" || name == "out", "MultiheadAttention",
              "no projection '{}' to adapt; expected qkv or out", name);
  register_module(name + "_lora", adapt_linear(name == "qkv" ? *qkv : *out, spec));
}

void MultiheadAttention::drop_adapters() {
  qkv->adapter = out->adapter = nullptr;
}

MLP::MLP(int64_t dim, int64_t hidden, MLPOptions options, Leaves leaves)
    : Module("MLP"), tanh_gelu_(options.tanh_gelu) {
  const Linears& linears = leaves.linear();
  fc1 = register_module("fc1", linears.column(dim, hidden, options.bias, options.generator));
  fc2 = register_module("fc2", linears.row(hidden, dim, options.bias, options.generator));
}

Tensor MLP::forward(const Tensor& x) {
  return (*fc2)(bias_gelu(fc1->forward_unbiased(x), fc1->bias, tanh_gelu_));
}

void MLP::adapt(const std::string& name, const AdapterSpec& spec) {
  WEAVE_CHECK(name == "fc1" || name == "fc2", "MLP",
              "no projection '{}' to adapt; expected fc1 or fc2", name);
  register_module(name + "_lora", adapt_linear(name == "fc1" ? *fc1 : *fc2, spec));
}

void MLP::drop_adapters() {
  fc1->adapter = fc2->adapter = nullptr;
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

GatedMLP::GatedMLP(int64_t dim, int64_t hidden, GatedMLPOptions options, Leaves leaves)
    : Module("GatedMLP"),
      gate_up(register_parameter("gate_up", Tensor())),
      gate_up_bias(register_parameter("gate_up_bias", Tensor())),
      activation_(options.activation),
      leaves_(std::move(leaves)),
      dim_(dim),
      hidden_(hidden) {
  const Linears& linears = leaves_.linear();
  WEAVE_CHECK(hidden > 0 && hidden % linears.parts() == 0, "GatedMLP",
              "hidden is {}, which does not divide among {} ranks; hint: pad it to a multiple "
              "of the tensor-parallel size",
              hidden, linears.parts());
  StackedProjection projection = linears.stacked(dim, hidden, options.bias, options.generator);
  gate_up = register_value(projection.weight, "gate_up");
  gate_up_bias = register_value(projection.bias, "gate_up_bias");
  down = register_module("down", linears.row(hidden, dim, options.bias, options.generator));
}

Tensor GatedMLP::forward(const Tensor& x) {
  const Tensor h = leaves_.linear().apply_stacked(x, gate_up, gate_up_bias, adapters_);
  return (*down)(gated_activation(h, activation_));
}

void GatedMLP::adapt(const std::string& name, const AdapterSpec& spec) {
  WEAVE_CHECK(name == "gate" || name == "up" || name == "down", "GatedMLP",
              "no projection '{}' to adapt; expected gate, up or down", name);
  if (name == "down") {
    register_module("down_lora", adapt_linear(*down, spec));
    return;
  }
  const int part = name == "gate" ? 0 : 1;
  auto adapter = adapt_stacked(gate_up, part, spec, [&](int64_t rank, Generator& g, DType dtype) {
    return leaves_.linear().column_adapter(dim_, hidden_, rank, g, dtype);
  });
  register_module(name + "_lora", adapter);
  adapters_[size_t(part)] = adapter.get();
}

void GatedMLP::drop_adapters() {
  down->adapter = nullptr;
  adapters_ = {};
}

TransformerBlock::TransformerBlock(int64_t dim, int64_t heads, TransformerBlockOptions options,
                                   Leaves leaves)
    : CachedModule("TransformerBlock") {
  const Linears& linears = leaves.linear();
  norm1 = register_module("norm1", linears.layer_norm(Shape{dim}, 1e-5));
  attention =
      register_module("attention", std::make_shared<MultiheadAttention>(
                                       dim, heads,
                                       MultiheadAttentionOptions{.bias = options.bias,
                                                                 .causal = options.causal,
                                                                 .dropout = options.dropout,
                                                                 .generator = options.generator},
                                       leaves));
  norm2 = register_module("norm2", linears.layer_norm(Shape{dim}, 1e-5));
  if (options.moe) {
    WEAVE_CHECK(options.moe->hidden == dim, "TransformerBlock",
                "the experts' moe.hidden must be the block's dim {}, found {}", dim,
                options.moe->hidden);
    moe = register_module("moe", leaves.expert().make(*options.moe));
  } else {
    mlp = register_module("mlp",
                          std::make_shared<MLP>(dim, options.hidden > 0 ? options.hidden : 4 * dim,
                                                MLPOptions{.bias = options.bias,
                                                           .tanh_gelu = options.tanh_gelu,
                                                           .generator = options.generator},
                                                leaves));
  }
  dropout_ =
      register_module("dropout", std::make_shared<Dropout>(options.dropout, options.generator));
  leaves.core().place(*this);
}

Tensor TransformerBlock::forward(const Tensor& x) {
  return run(x, nullptr);
}

Tensor TransformerBlock::forward(const Inputs& inputs, KVCache& cache) {
  return run(inputs.x, &cache);
}

Tensor TransformerBlock::aux_loss() const {
  return moe ? moe->aux_loss() : Tensor();
}

Tensor TransformerBlock::run(const Tensor& x, KVCache* cache) {
  Tensor normed = (*norm1)(x);
  Tensor h =
      x + (*dropout_)(cache ? attention->forward(Inputs(normed), *cache) : (*attention)(normed));
  return h + (*dropout_)(mlp ? (*mlp)((*norm2)(h)) : moe->with_aux_loss((*moe)((*norm2)(h))));
}

}  // namespace weave::nn

// Grouped-query attention with rotary positions.
#include "weave/nn/grouped_query_attention.h"

#include "weave/autograd/grad_mode.h"
#include "weave/nn/deferred.h"

#include <cmath>

namespace weave::nn {

namespace {

constexpr const char* kAttention = "GroupedQueryAttention";

}  // namespace

GroupedQueryAttention::GroupedQueryAttention(int64_t dim, GroupedQueryAttentionOptions options,
                                             Leaves leaves)
    : CachedModule("GroupedQueryAttention"),
      kv(register_parameter("kv", Tensor())),
      kv_bias(register_parameter("kv_bias", Tensor())),
      q_norm(register_parameter("q_norm", Tensor())),
      k_norm(register_parameter("k_norm", Tensor())),
      dim_(dim),
      head_dim_(0),
      kv_heads_(options.kv_heads == 0 ? options.heads : options.kv_heads),
      local_heads_(0),
      options_(options),
      leaves_(std::move(leaves)) {
  WEAVE_CHECK(options.heads > 0 && dim > 0 && options.head_dim >= 0, kAttention,
              "dim {}, heads {} and head_dim {} must be positive (head_dim 0: dim / heads)", dim,
              options.heads, options.head_dim);
  WEAVE_CHECK(options.head_dim > 0 || dim % options.heads == 0, kAttention,
              "dim {} must be a multiple of heads {} when head_dim is left to dim / heads", dim,
              options.heads);
  WEAVE_CHECK(!options.scale || (std::isfinite(*options.scale) && *options.scale > 0), kAttention,
              "scale must be positive and finite, found {}", options.scale.value_or(0));
  WEAVE_CHECK(options.window >= 0 && (options.window == 0 || options.causal), kAttention,
              "window {} needs causal attention and a size >= 0 (0: no window)", options.window);
  WEAVE_CHECK(options.softcap >= 0 && std::isfinite(options.softcap), kAttention,
              "softcap must be finite and >= 0 (0: none), found {}", options.softcap);
  WEAVE_CHECK(kv_heads_ > 0 && options.heads % kv_heads_ == 0, kAttention,
              "kv_heads {} must divide heads {} (each key/value head serves a whole group of "
              "query heads)",
              kv_heads_, options.heads);
  const Linears& linears = leaves_.linear();
  const int64_t parts = linears.parts();
  WEAVE_CHECK(options.heads % parts == 0 && (kv_heads_ % parts == 0 || parts % kv_heads_ == 0),
              kAttention,
              "{} query heads and {} key/value heads over {} ranks: the query heads must divide "
              "among the ranks, and the key/value heads divide among them or the ranks among the "
              "key/value heads; hint: a tensor-parallel size that divides both, or a multiple of "
              "kv_heads",
              options.heads, kv_heads_, parts);
  leaves_.core().check(kAttention, /*decoding=*/false, options.dropout > 0);
  head_dim_ = options.head_dim > 0 ? options.head_dim : dim / options.heads;
  WEAVE_CHECK(!options.rotary || options.rotary->rotary_dim > 0 || head_dim_ % 2 == 0, kAttention,
              "rotary embeddings turn pairs of a head's dims: head_dim {} must be even", head_dim_);
  local_heads_ = options.heads / parts;
  const int64_t width = options.heads * head_dim_;
  // The whole layer's initialization, in its order (q, kv, out), then cut.
  q = register_module("q", linears.column(dim, width, options.bias, options.generator));
  auto [projection, layout] =
      linears.key_values(dim, options.heads, kv_heads_, head_dim_, options.bias, options.generator);
  kv = register_value(projection.weight, "kv");
  kv_bias = register_value(projection.bias, "kv_bias");
  kv_layout_ = layout;
  out = register_module("out", linears.row(width, dim, options.out_bias, options.generator));
  if (options.qk_norm) {
    const double start = options.qk_norm->unit_offset ? 0.0 : 1.0;
    q_norm = register_value(init::constant_parameter({head_dim_}, start), "q_norm");
    k_norm = register_value(init::constant_parameter({head_dim_}, start), "k_norm");
  }
  leaves_.core().place(*this);
}

Tensor GroupedQueryAttention::forward(const Tensor& x) {
  return forward_inputs(Inputs(x));
}

Tensor GroupedQueryAttention::forward_inputs(const Inputs& inputs) {
  return attend(inputs, nullptr);
}

Tensor GroupedQueryAttention::forward(const Inputs& inputs, KVCache& cache) {
  leaves_.linear().check_decoding(kAttention);
  leaves_.core().check(kAttention, /*decoding=*/true, false);
  WEAVE_CHECK(!inputs.document_ids.defined(), kAttention,
              "decoding with a key/value cache takes one document a row; hint: pass no "
              "document_ids");
  return attend(inputs, &cache);
}

Tensor GroupedQueryAttention::attend(const Inputs& inputs, KVCache* cache) {
  const Tensor& x = inputs.x;
  WEAVE_CHECK(x.defined() && x.dim() == 3 && x.size(2) == dim_, kAttention,
              "expected input [B, T, {}], found {}", dim_, x.defined() ? x.shape() : Shape{});
  const int64_t batch = x.size(0), length = x.size(1);
  Tensor queries = (*q)(x).reshape({batch, length, local_heads_, head_dim_});
  Tensor projected = leaves_.linear()
                         .project_key_values(x, kv, kv_bias, kv_layout_, head_dim_, kv_adapters_)
                         .reshape({batch, length, 2, kv_layout_.local, head_dim_});
  Tensor keys = projected.select(2, 0), values = projected.select(2, 1);
  if (options_.qk_norm) {
    queries = norm_heads(queries, q_norm);
    keys = norm_heads(keys, k_norm);
  }
  if (options_.rotary) {
    Tensor positions = inputs.positions;
    if (!positions.defined())  // after the cached positions, or this rank's part of 0 .. T - 1
      positions = cache ? position_ids(cache->length(), length, x.device())
                        : leaves_.core().positions(0, length, x.device());
    queries = rotary_embedding(queries, positions, *options_.rotary);
    keys = rotary_embedding(keys, positions, *options_.rotary);
  }
  Tensor k = keys.transpose(1, 2), v = values.transpose(1, 2);
  if (cache) std::tie(k, v) = cache->append(k, v, options_.window);
  Tensor y = leaves_.core().attend(queries.transpose(1, 2), k, v,
                                   {.causal = options_.causal,
                                    .scale = options_.scale,
                                    .dropout_p = is_training() ? options_.dropout : 0.0,
                                    .generator = options_.generator,
                                    .document_ids = inputs.document_ids,
                                    .window = options_.window,
                                    .softcap = options_.softcap});
  // heads-last: a view
  return (*out)(y.transpose(1, 2).reshape({batch, length, local_heads_ * head_dim_}));
}

void GroupedQueryAttention::adapt(const std::string& name, const AdapterSpec& spec) {
  WEAVE_CHECK(name == "q" || name == "k" || name == "v" || name == "out", kAttention,
              "no projection '{}' to adapt; expected q, k, v or out", name);
  if (name == "q" || name == "out") {
    register_module(name + "_lora", adapt_linear(name == "q" ? *q : *out, spec));
    return;
  }
  const int part = name == "k" ? 0 : 1;
  const int64_t rows = kv_heads_ * head_dim_;
  // Cut as kv is: whole on every rank when its heads are fewer than the ranks.
  auto adapter = adapt_stacked(kv, part, spec, [&](int64_t rank, Generator& g, DType dtype) {
    return kv_layout_.replicated ? low_rank_factors(dim_, rows, rank, g, dtype)
                                 : leaves_.linear().column_adapter(dim_, rows, rank, g, dtype);
  });
  register_module(name + "_lora", adapter);
  kv_adapters_[size_t(part)] = adapter.get();
}

void GroupedQueryAttention::drop_adapters() {
  q->adapter = out->adapter = nullptr;
  kv_adapters_ = {};
}

// Each head's RMSNorm; the weight is whole on every rank of a split layer, which norms only its
// own heads, so its gradient is summed over the ranks.
Tensor GroupedQueryAttention::norm_heads(const Tensor& x, const Tensor& weight) const {
  Tensor w = leaves_.linear().shared_by_parts(weight);
  if (options_.qk_norm->unit_offset) w = w + 1.0;
  return rms_norm(x, {head_dim_}, w, options_.qk_norm->eps);
}

}  // namespace weave::nn

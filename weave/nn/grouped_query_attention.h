#pragma once
// Grouped-query attention with rotary positions (Llama, Mistral, Qwen): `kv_heads` key/value heads
// shared by `heads` query heads. It reads the side inputs of nn::Inputs: the tokens' positions
// and, for windows packed with several documents, the document ids (attention stays within a
// document; positions restart at each).
//
//   nn::GroupedQueryAttention attention(512, {.heads = 8, .kv_heads = 2,
//                                             .rotary = {.base = 500000}});
//   Tensor y = attention({x, positions, document_ids});  // x [B, T, 512]; ids [B, T] or [T]
//   Tensor z = attention(x);                             // positions 0 .. T-1, one document
//   // Qwen 3's: heads of their own size, each query and key head RMS-normed before rotary
//   nn::GroupedQueryAttention qwen3(1024, {.heads = 16, .head_dim = 128, .kv_heads = 8,
//                                          .qk_norm = nn::HeadNormOptions{}});
#include <optional>

#include "weave/nn/leaves.h"
#include "weave/nn/transformer.h"

namespace weave::nn {

/// RMSNorm of every query and key head over its head_dim (Qwen 3's and Gemma 3's q_norm and
/// k_norm), before the rotary embedding.
struct HeadNormOptions {
  double eps = 1e-6;
  /// Scales by (1 + weight), the weight starting at 0 (Gemma's RMSNorm); else by the weight,
  /// starting at 1.
  bool unit_offset = false;
};

struct GroupedQueryAttentionOptions {
  int64_t heads = 8;
  /// Each head's size; 0: dim / heads (Qwen 3 and Gemma 3 choose it apart from dim / heads).
  int64_t head_dim = 0;
  /// Key/value heads, dividing heads (1: multi-query attention); 0: as many as heads.
  int64_t kv_heads = 0;
  /// Biases of the q and kv projections (Qwen 2's q, k and v have them; Llama's none).
  bool bias = false;
  /// A bias of the out projection.
  bool out_bias = false;
  bool causal = true;
  /// Per-head RMSNorm of q and k (weights q_norm and k_norm [head_dim]); none when unset.
  std::optional<HeadNormOptions> qk_norm{};
  /// Multiplies q k^T; 1 / sqrt(head_dim) when unset (Gemma: query_pre_attn_scalar^-1/2).
  std::optional<double> scale{};
  /// Sliding window (with causal): each position attends to its `window` latest positions,
  /// itself included (Mistral's sliding_window, Gemma's local layers); 0: every earlier one. A
  /// key/value cache then keeps only the window - 1 latest positions.
  int64_t window = 0;
  /// Soft-caps the scores: softcap tanh(s / softcap) (Gemma 2's attn_logit_softcapping); 0: none.
  double softcap = 0.0;
  /// Rotary embeddings of q and k; none when unset.
  std::optional<RotaryOptions> rotary = RotaryOptions{};
  /// Dropout on the attention probabilities, in training mode.
  double dropout = 0.0;
  Generator* generator = nullptr;
};

/// Self-attention with `kv_heads` key/value heads shared by `heads` query heads. The query
/// projection q [heads * head_dim, dim], the key/value projection kv [2, kv_heads *
/// head_dim, dim] and the output projection out [dim, heads * head_dim] (kv[0] for keys, kv[1] for
/// values: one GEMM) are separate, so a tensor- parallel split cuts each along its heads. Keys and
/// values are never repeated per query head (scaled_dot_product_attention reads the shared heads in
/// place).
///
/// Its leaves (nn/leaves.h) split it: over a tensor-parallel group rank r holds query heads
/// [r H / n, (r + 1) H / n) (q column-parallel) and out's matching columns (row-parallel), and
/// the key/value heads those queries read (every rank the whole kv when they are fewer than the
/// ranks, its gradient summed: Megatron's replicated key/value heads), and the whole q_norm and
/// k_norm (their gradients summed over the group); over a context group each
/// rank passes its part of every sequence with that part's positions and document ids (the
/// positions derived from the part's place when left out).
///
/// Its projections take low-rank adapters (nn/lora.h): q, k, v (the halves of kv) and out.
class GroupedQueryAttention : public CachedModule, public AdaptedLayer {
 public:
  GroupedQueryAttention(int64_t dim, GroupedQueryAttentionOptions options = {}, Leaves leaves = {});
  /// x [B, T, dim] -> [B, T, dim], at positions 0 .. T-1, one document.
  Tensor forward(const Tensor& x) override;
  /// The same at inputs.positions, attending within inputs.document_ids.
  Tensor forward_inputs(const Inputs& inputs) override;
  /// x after the positions `cache` holds (at positions cache.length() onwards unless
  /// inputs.positions says), attending to them too; appends this call's keys and values.
  Tensor forward(const Inputs& inputs, KVCache& cache) override;
  int64_t heads() const { return options_.heads; }
  int64_t kv_heads() const { return kv_heads_; }
  /// This rank's query heads and key/value heads (all of them when whole).
  int64_t local_heads() const { return local_heads_; }
  int64_t local_kv_heads() const { return kv_layout_.local; }
  int64_t head_dim() const { return head_dim_; }
  std::shared_ptr<LinearLeaf> q;    // [heads * head_dim, dim] (this rank's rows when split)
  Tensor& kv;                       // [2, kv_heads * head_dim, dim] (this rank's heads, or all)
  Tensor& kv_bias;                  // [2, kv_heads * head_dim], undefined without bias
  std::shared_ptr<LinearLeaf> out;  // [dim, heads * head_dim] (this rank's columns when split)
  Tensor& q_norm;                   // [head_dim], undefined without qk_norm
  Tensor& k_norm;                   // [head_dim], undefined without qk_norm
  std::vector<std::string> projections() const override { return {"q", "k", "v", "out"}; }
  void adapt(const std::string& name, const AdapterSpec& spec) override;
  void drop_adapters() override;

 private:
  Tensor attend(const Inputs& inputs, KVCache* cache);
  Tensor norm_heads(const Tensor& x, const Tensor& weight) const;
  int64_t dim_, head_dim_, kv_heads_, local_heads_;
  GroupedQueryAttentionOptions options_;
  Leaves leaves_;
  Linears::KeyValueHeads kv_layout_;
  StackedAdapters kv_adapters_{};
};

}  // namespace weave::nn

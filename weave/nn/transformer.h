#pragma once
// Transformer layers: multi-head self-attention on the fused attention op, a pre-LayerNorm
// block, and the key/value cache that makes generation cost one position per step.
//
//   nn::TransformerBlock block(384, 6, {.causal = true, .dropout = 0.1});
//   Tensor y = block(x);                       // x [B, T, 384] -> [B, T, 384]
//
//   nn::KVCache cache(256);                    // generation: feed the prompt, then one token
//   Tensor h = block.forward(prompt, cache);   // at a time; each call appends to the cache
//   Tensor next = block.forward(token, cache);
#include <optional>
#include <utility>

#include "weave/nn/layers.h"
#include "weave/nn/leaves.h"
#include "weave/nn/moe.h"

namespace weave::nn {

/// Keys and values of the positions seen so far, for one attention layer (inference: it holds
/// no history for autograd). Storage for max_length positions is allocated at the first append.
class KVCache {
 public:
  explicit KVCache(int64_t max_length);
  /// Appends k and v [B, H, T, D] and returns the keys and values this call's queries attend to
  /// [B, H, held, D]: every cached position, or with a sliding window (> 0; the same on every
  /// call) the window - 1 latest before this call's T. A windowed cache keeps only those
  /// window - 1 between calls; others keep every position.
  std::pair<Tensor, Tensor> append(const Tensor& k, const Tensor& v, int64_t window = 0);
  /// Positions seen since the start (the next call's first position).
  int64_t length() const { return length_; }
  /// Positions held between calls: length(), or at most window - 1 with a window.
  int64_t held() const { return held_; }
  int64_t max_length() const { return max_length_; }
  /// Forgets every position (a new sequence); the storage is kept.
  void reset() { length_ = held_ = 0; }

 private:
  std::pair<Tensor, Tensor> append_windowed(const Tensor& k, const Tensor& v);
  int64_t max_length_, length_ = 0, held_ = 0, window_ = -1;  // -1: not yet appended
  Tensor keys_, values_;
};

/// The one decoding face: what decodes with a key/value cache (an attention layer, a block that
/// holds one). inputs.x sits after the positions `cache` holds; the layer attends to them too and
/// appends this call's keys and values.
class CachedModule : public Module {
 public:
  using Module::forward;
  using Module::Module;
  virtual Tensor forward(const Inputs& inputs, KVCache& cache) = 0;
};

/// Self-attention over a fused projection (MultiheadAttention's core). qkv [B, T, heads * 3 *
/// head_dim] holds, head by head, that head's query, key and value (head-major, as Megatron-LM lays
/// it out, so that splitting the projection's rows into contiguous pieces gives each piece whole
/// heads). Strided views are accepted (no copy while the last dim has unit stride). Keys and values
/// go through `cache` when one is given. Returns [B, T, heads * head_dim], a view of contiguous
/// memory.
Tensor fused_qkv_attention(const Tensor& qkv, int64_t heads, const AttentionOptions& options,
                           KVCache* cache = nullptr);
/// The same split of qkv into heads, with `attend` (q, k, v [B, heads, T, head_dim] -> [B, heads,
/// T, head_dim]) in place of scaled_dot_product_attention: context-parallel attention plugs in
/// here.
Tensor fused_qkv_attention(
    const Tensor& qkv, int64_t heads,
    const std::function<Tensor(const Tensor& q, const Tensor& k, const Tensor& v)>& attend);

struct MultiheadAttentionOptions {
  bool bias = true;
  /// Each position attends only to itself and earlier ones (a decoder).
  bool causal = false;
  /// Dropout on the attention probabilities, in training mode (drawn from `generator`; split
  /// over a tensor-parallel group, in lockstep when every rank seeds it alike).
  double dropout = 0.0;
  Generator* generator = nullptr;
};

/// Self-attention with `heads` heads of dim / heads each. One fused projection makes q, k and v
/// ([dim] -> [3 dim], read as [heads, 3, head_dim]: head-major, so that a column-parallel split
/// of its rows gives each rank whole heads); the heads are strided views of it, passed to the
/// core attention without a copy, whose output merges back into [B, T, dim] as a view before
/// the output projection (row-parallel when split). Batch first, [B, T, dim], also under
/// sequence parallelism (which cuts dim 1).
///
/// Its projections take low-rank adapters (nn/lora.h): qkv and out.
class MultiheadAttention : public CachedModule, public AdaptedLayer {
 public:
  MultiheadAttention(int64_t dim, int64_t heads, MultiheadAttentionOptions options = {},
                     Leaves leaves = {});
  /// x [B, T, dim] -> [B, T, dim].
  Tensor forward(const Tensor& x) override;
  /// The same, attending also to the positions in `cache` (and adding this call's to it).
  Tensor forward(const Inputs& inputs, KVCache& cache) override;
  int64_t heads() const { return heads_; }
  /// This rank's heads (all of them when whole).
  int64_t local_heads() const { return local_heads_; }
  std::shared_ptr<LinearLeaf> qkv;  // [3 dim, dim], rows [heads, 3, head_dim]
  std::shared_ptr<LinearLeaf> out;  // [dim, dim]
  std::vector<std::string> projections() const override { return {"qkv", "out"}; }
  void adapt(const std::string& name, const AdapterSpec& spec) override;
  void drop_adapters() override;

 private:
  Tensor attend(const Tensor& x, KVCache* cache);
  int64_t dim_, heads_, local_heads_;
  MultiheadAttentionOptions options_;
  Leaves leaves_;
};

struct MLPOptions {
  bool bias = true;
  /// gelu_tanh (GPT-2's) instead of the exact GELU.
  bool tanh_gelu = false;
  Generator* generator = nullptr;
};

/// A transformer's feed-forward network: fc2(GELU(fc1(x))), fc1's bias and the GELU fused
/// (bias_gelu: one pass forward, one backward). Split, fc1 is column-parallel and fc2
/// row-parallel. Its projections take low-rank adapters (nn/lora.h): fc1 and fc2.
class MLP : public Module, public AdaptedLayer {
 public:
  MLP(int64_t dim, int64_t hidden, MLPOptions options = {}, Leaves leaves = {});
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<LinearLeaf> fc1, fc2;  // [hidden, dim], [dim, hidden]
  std::vector<std::string> projections() const override { return {"fc1", "fc2"}; }
  void adapt(const std::string& name, const AdapterSpec& spec) override;
  void drop_adapters() override;

 private:
  bool tanh_gelu_;
};

/// The activation of a gated MLP: silu (SwiGLU: Llama, Mistral, Qwen) or gelu (GeGLU: Gemma).
enum class GatedActivation { SiLU, GELU, GELUTanh };

/// act(gate) * up for gate_up [..., 2F] (the gate in its first half): swiglu or geglu.
Tensor gated_activation(const Tensor& gate_up, GatedActivation activation);

struct GatedMLPOptions {
  GatedActivation activation = GatedActivation::SiLU;
  /// Llama's projections have no bias.
  bool bias = false;
  Generator* generator = nullptr;
};

/// A gated feed-forward network: down(act(x Wg^T) * (x Wu^T)). The gate and up weights are one
/// parameter gate_up [2, hidden, dim] (gate_up[0] is Wg, gate_up[1] is Wu), so both
/// projections take one GEMM and the product one pass (swiglu/geglu); split, each rank holds
/// its piece of both along hidden (still one GEMM) and down is row-parallel. Its projections take
/// low-rank adapters (nn/lora.h): gate, up (the halves of gate_up) and down.
class GatedMLP : public Module, public AdaptedLayer {
 public:
  GatedMLP(int64_t dim, int64_t hidden, GatedMLPOptions options = {}, Leaves leaves = {});
  /// x [..., dim] -> [..., dim].
  Tensor forward(const Tensor& x) override;
  Tensor& gate_up;                   // [2, hidden, dim] (this rank's piece of hidden)
  Tensor& gate_up_bias;              // [2, hidden], undefined without bias
  std::shared_ptr<LinearLeaf> down;  // [dim, hidden]
  std::vector<std::string> projections() const override { return {"gate", "up", "down"}; }
  void adapt(const std::string& name, const AdapterSpec& spec) override;
  void drop_adapters() override;
  GatedActivation activation() const { return activation_; }

 private:
  GatedActivation activation_;
  Leaves leaves_;
  int64_t dim_, hidden_;
  StackedAdapters adapters_{};
};

struct TransformerBlockOptions {
  /// The MLP's hidden width; 4 dim when 0.
  int64_t hidden = 0;
  bool causal = true;
  /// Dropout on the attention probabilities and on both residual branches, in training mode.
  double dropout = 0.0;
  bool bias = true;
  /// gelu_tanh (GPT-2's) instead of the exact GELU.
  bool tanh_gelu = false;
  Generator* generator = nullptr;
  /// A mixture of experts in place of the MLP (moe->hidden is dim), registered as "moe" (the
  /// leaves' experts: all here, or spread over an expert group). While training, its balancing
  /// loss travels with the block's output into backward (MoE::with_aux_loss): add nothing.
  std::optional<MoEOptions> moe = std::nullopt;
};

/// A pre-LayerNorm block (GPT-2): h = x + attention(norm1(x)), then h + mlp(norm2(h)), batch
/// first. Split by its leaves like its layers; under sequence parallelism the norms, residuals
/// and dropout run on this rank's part of the sequence (dim 1).
class TransformerBlock : public CachedModule {
 public:
  TransformerBlock(int64_t dim, int64_t heads, TransformerBlockOptions options = {},
                   Leaves leaves = {});
  Tensor forward(const Tensor& x) override;
  /// With a key/value cache for this block's attention (generation).
  Tensor forward(const Inputs& inputs, KVCache& cache) override;
  /// The last forward's load-balancing and z-loss, for reporting (undefined without experts);
  /// backward already differentiates it.
  Tensor aux_loss() const;
  /// nn::LayerNorm (its sequence-parallel form under sequence parallelism).
  std::shared_ptr<Module> norm1, norm2;
  std::shared_ptr<MultiheadAttention> attention;
  /// The MLP, or (with options.moe) null and `moe` the mixture of experts.
  std::shared_ptr<MLP> mlp;
  std::shared_ptr<MoE> moe;

 private:
  Tensor run(const Tensor& x, KVCache* cache);
  std::shared_ptr<Dropout> dropout_;
};

}  // namespace weave::nn

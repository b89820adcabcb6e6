#pragma once
// Where a transformer layer's pieces come from (Megatron-core's submodule specs, MLX's leaf
// swap). Each layer of nn/ (attention, MLP, block) is written once and asks its Leaves for its
// linear pieces, its core attention and its experts. The defaults are whole: nn::Linear,
// scaled_dot_product_attention and experts all on this process, so nn/ knows no group.
// parallel/ supplies the others, each strategy its own kind:
//
//   linears     parallel::TensorParallelLinears (tensor_parallel.h): Megatron's column and row
//               linears, heads and hidden units split, key/value heads replicated when fewer
//               than the ranks, sequence parallelism
//   attention   parallel::ContextAttention (context_parallel.h): ring or all-to-all attention
//               over a context group, each rank holding its part of every sequence
//   experts     parallel::SpreadExperts (experts.h): experts spread over an expert group
//
//   nn::GroupedQueryAttention whole(512, {.heads = 8, .kv_heads = 2});
//   nn::GroupedQueryAttention part(512, {.heads = 8, .kv_heads = 2},
//                                  {.linears = parallel::tensor_parallel(mesh.tensor()),
//                                   .attention = parallel::context_attention({mesh.context()})});
//
// Built from the same seed, a split layer holds the slices of the whole layer under the same
// parameter names (its initialization is the whole layer's, then cut).
#include <memory>

#include "weave/nn/layers.h"
#include "weave/nn/lora.h"

namespace weave::nn {

class MoE;
struct MoEOptions;

/// The linear pieces of layers: whole here. A subclass splits them over ranks.
class Linears {
 public:
  virtual ~Linears() = default;
  /// How many ranks split the heads and hidden units (1: whole layers).
  virtual int64_t parts() const { return 1; }
  /// A linear [out, in] whose output features are split (this rank computes its piece of y).
  virtual std::shared_ptr<LinearLeaf> column(int64_t in, int64_t out, bool bias,
                                             Generator* generator) const;
  /// A linear [out, in] whose input features are split (the input is a column's piece; the
  /// partial products are summed over the ranks, then the bias added).
  virtual std::shared_ptr<LinearLeaf> row(int64_t in, int64_t out, bool bias,
                                          Generator* generator) const;
  /// Two projections of one input stacked [2, width, in] (a gated MLP's gate and up), split
  /// along width: this rank's piece, initialized as the whole (stacked_projection).
  virtual StackedProjection stacked(int64_t in, int64_t width, bool bias,
                                    Generator* generator) const;
  /// x [..., in] through a stacked piece: [..., 2 width / parts] (the input's gradient summed
  /// over the ranks), with each half's adapter update added (nn/lora.h; null: none).
  virtual Tensor apply_stacked(const Tensor& x, const Tensor& weight, const Tensor& bias,
                               const StackedAdapters& adapters) const;
  /// An adapter's factors for a projection [out, in] cut as a column piece or a stacked one's
  /// half is (whole here; split: A whole, B this rank's rows).
  virtual LowRankFactors column_adapter(int64_t in, int64_t out, int64_t rank, Generator& generator,
                                        DType dtype) const;

  /// Grouped-query attention's key/value projection [2, kv_heads * head_dim, dim]: which of it
  /// this rank holds and projects.
  struct KeyValueHeads {
    /// Heads this rank projects, from head `first` of what it holds.
    int64_t local = 0, first = 0;
    /// Whether it holds all of them (fewer heads than ranks), reading only its own.
    bool replicated = false;
  };
  /// The projection (this rank's piece, or the whole one when the heads are fewer than the
  /// ranks) and which heads of it this rank's `heads / parts()` query heads read.
  virtual std::pair<StackedProjection, KeyValueHeads> key_values(int64_t dim, int64_t heads,
                                                                 int64_t kv_heads, int64_t head_dim,
                                                                 bool bias,
                                                                 Generator* generator) const;
  /// x [B, T, dim] -> [B, T, 2 * heads.local * head_dim]: this rank's keys, then its values, with
  /// their adapters' updates (cut as the projection: whole when it is replicated).
  virtual Tensor project_key_values(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                    const KeyValueHeads& heads, int64_t head_dim,
                                    const StackedAdapters& adapters) const;

  /// A parameter every rank holds whole but applies to its own heads only (per-head norms): its
  /// gradient summed over the ranks (identity when whole).
  virtual Tensor shared_by_parts(const Tensor& parameter) const { return parameter; }
  /// A LayerNorm over the layers' activations (sequence parallelism: over this rank's part of
  /// the sequence, its gradients summed over the ranks).
  virtual std::shared_ptr<Module> layer_norm(const Shape& shape, double eps) const;
  /// Raises, naming `layer`, unless one position at a time can pass (decoding with a cache).
  virtual void check_decoding(const char* layer) const { (void)layer; }
};

/// The core of attention, q k v to output: scaled_dot_product_attention here.
class CoreAttention {
 public:
  virtual ~CoreAttention() = default;
  /// q [B, H, T, D], k and v [B, Hkv, T', D] -> [B, H, T, D].
  virtual Tensor attend(const Tensor& q, const Tensor& k, const Tensor& v,
                        const AttentionOptions& options) const;
  /// The positions of this rank's `length` positions of a sequence starting at `start`
  /// (int64 [length]).
  virtual Tensor positions(int64_t start, int64_t length, Device device) const;
  /// Raises, naming `layer`, unless the layer can decode with a key/value cache, or take
  /// attention dropout (dropout true).
  virtual void check(const char* layer, bool decoding, bool dropout) const;
  /// Records on `layer`'s parameters how this attention reads them (context parallelism: each
  /// rank a part of every sequence).
  virtual void place(const Module& layer) const { (void)layer; }
};

/// Experts in place of an MLP: every expert on this process here.
class ExpertLeaves {
 public:
  virtual ~ExpertLeaves() = default;
  virtual std::shared_ptr<MoE> make(const MoEOptions& options) const;
};

/// A layer's leaves: whole unless set.
struct Leaves {
  std::shared_ptr<const Linears> linears = nullptr;
  std::shared_ptr<const CoreAttention> attention = nullptr;
  std::shared_ptr<const ExpertLeaves> experts = nullptr;
  const Linears& linear() const;
  const CoreAttention& core() const;
  const ExpertLeaves& expert() const;
};

}  // namespace weave::nn

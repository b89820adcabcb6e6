#pragma once
// Tensor parallelism (Megatron-LM): layers whose weights are split across the ranks of a
// tensor-parallel group, so each rank stores and multiplies 1/n of them.
//
//   dist::Group tp = mesh.tensor();
//   parallel::ColumnParallelLinear fc1(784, 256, tp);        // output features split
//   parallel::RowParallelLinear fc2(256, 10, tp);            // input features split, summed
//   Tensor logits = fc2(relu(fc1(x)));                       // the same on every rank of tp
//   cross_entropy(logits, y).backward();
//
// Convention: inside a tensor-parallel region the loss is replicated (every rank of the group
// computes the same loss, counted once), so a parameter that is not split gets the same
// gradient on every rank. Layers are built from the unsharded layer's initialization: with
// the same seed on every rank, the sharded model equals nn::Linear / nn::Embedding built with
// that seed, split (tests rely on it; so can users comparing against one process).
//
// Sequence parallelism (ColumnParallelOptions::sequence_parallel and friends): activations
// outside the tensor-parallel matmuls are split along the sequence axis (sequence_axis: 1 in
// the [batch, sequence, hidden] layout the transformer layers use, 0 in [sequence, batch,
// hidden]), a column layer all_gathers its input and a row layer reduce_scatters its output;
// parameters applied to sequence shards (the row layer's bias, SequenceParallelLayerNorm) sum
// their gradients over the group in backward.
//
// The transformer layers of nn/ take their pieces from TensorParallelLinears (nn/leaves.h):
//
//   nn::TransformerBlock block(384, 6, {.causal = true}, {.linears =
//   parallel::tensor_parallel(tp)});
#include <cstdint>
#include <map>
#include <string>

#include "weave/distributed/distributed.h"
#include "weave/nn/layers.h"
#include "weave/nn/leaves.h"
#include "weave/parallel/core/placement.h"

namespace weave::parallel {

/// A layer with parameters split across a group (each records a Split cut on its slices).
class ShardedModule : public nn::Module {
 public:
  ShardedModule(std::string name, dist::Group group)
      : nn::Module(std::move(name)), group_(std::move(group)) {}
  const dist::Group& group() const { return group_; }

 private:
  dist::Group group_;
};

struct ColumnParallelOptions {
  bool bias = true;
  /// all_gather the output pieces along the last axis (the full output on every rank).
  bool gather_output = false;
  /// Input split along sequence_axis, all_gathered before the matmul.
  bool sequence_parallel = false;
  int sequence_axis = 1;
  /// Leave the bias out of forward's result, for the caller to fuse it with what follows
  /// (bias_gelu); the bias is still this layer's parameter.
  bool skip_bias_add = false;
  Generator* generator = nullptr;
};

/// y = x W^T + b with W [out, in] split by rows (output features): rank r holds rows
/// [r out/n, (r+1) out/n) and computes that slice of y. out must divide by the group size.
/// weight [out / n, in], bias [out / n] (undefined without bias).
class ColumnParallelLinear : public nn::LinearLeaf {
 public:
  ColumnParallelLinear(int64_t in_features, int64_t out_features, dist::Group group,
                       ColumnParallelOptions options = {});
  Tensor forward(const Tensor& x) override;
  Tensor forward_unbiased(const Tensor& x) override;
  /// A whole on every rank (its gradient summed over the group), B this rank's rows.
  nn::LowRankFactors adapter_factors(int64_t rank, Generator& generator,
                                     DType dtype) const override;
  const dist::Group& group() const { return group_; }

 private:
  Tensor project(const Tensor& x, const Tensor& with_bias);
  dist::Group group_;
  ColumnParallelOptions options_;
};

struct RowParallelOptions {
  bool bias = true;
  /// The input's last axis is already split (the output of a ColumnParallelLinear); otherwise
  /// each rank keeps its slice of the full input.
  bool input_is_parallel = true;
  /// reduce_scatter the output along sequence_axis instead of all_reducing it.
  bool sequence_parallel = false;
  int sequence_axis = 1;
  Generator* generator = nullptr;
};

/// y = x W^T + b with W [out, in] split by columns (input features): rank r multiplies its
/// slice of x by its columns and the partial products are summed over the group. The bias is
/// replicated and added once, after the sum. in must divide by the group size. weight
/// [out, in / n], bias [out] (replicated).
class RowParallelLinear : public nn::LinearLeaf {
 public:
  RowParallelLinear(int64_t in_features, int64_t out_features, dist::Group group,
                    RowParallelOptions options = {});
  Tensor forward(const Tensor& x) override;
  /// The summed products without the bias.
  Tensor forward_unbiased(const Tensor& x) override;
  /// A this rank's columns, B whole on every rank (its gradient summed over the group): the
  /// update's partial products join the base's sum.
  nn::LowRankFactors adapter_factors(int64_t rank, Generator& generator,
                                     DType dtype) const override;
  const dist::Group& group() const { return group_; }

 private:
  dist::Group group_;
  RowParallelOptions options_;
};

/// LayerNorm applied to sequence shards: its weight and bias gradients are summed over the
/// group in backward (each rank saw only its part of the sequence).
class SequenceParallelLayerNorm : public ShardedModule {
 public:
  SequenceParallelLayerNorm(const Shape& normalized_shape, dist::Group group, double eps = 1e-5);
  Tensor forward(const Tensor& x) override;
  Tensor& weight;
  Tensor& bias;

 private:
  Shape shape_;
  double eps_;
};

/// The linear pieces of the transformer layers of nn/ split over a tensor-parallel group
/// (Megatron-LM): fused and query projections, gated MLPs' gate and up, and the first MLP layer
/// column-parallel (this rank's heads or hidden units), the output projections row-parallel;
/// grouped-query attention's key/value heads split alike when the ranks divide them, else whole
/// on every rank, each projecting the heads its queries read, their gradient summed (Megatron's
/// replicated key/value heads). With sequence_parallel the activations between the matmuls are
/// this rank's part of the sequence (dim 1 of [B, T, dim]) and the norms sum their gradients;
/// decoding with a cache raises then.
struct TensorParallelOptions {
  bool sequence_parallel = false;
};
class TensorParallelLinears : public nn::Linears {
 public:
  TensorParallelLinears(dist::Group group, TensorParallelOptions options = {});
  int64_t parts() const override { return group_.size(); }
  std::shared_ptr<nn::LinearLeaf> column(int64_t in, int64_t out, bool bias,
                                         Generator* generator) const override;
  std::shared_ptr<nn::LinearLeaf> row(int64_t in, int64_t out, bool bias,
                                      Generator* generator) const override;
  nn::StackedProjection stacked(int64_t in, int64_t width, bool bias,
                                Generator* generator) const override;
  Tensor apply_stacked(const Tensor& x, const Tensor& weight, const Tensor& bias,
                       const nn::StackedAdapters& adapters) const override;
  nn::LowRankFactors column_adapter(int64_t in, int64_t out, int64_t rank, Generator& generator,
                                    DType dtype) const override;
  std::pair<nn::StackedProjection, KeyValueHeads> key_values(int64_t dim, int64_t heads,
                                                             int64_t kv_heads, int64_t head_dim,
                                                             bool bias,
                                                             Generator* generator) const override;
  Tensor project_key_values(const Tensor& x, const Tensor& weight, const Tensor& bias,
                            const KeyValueHeads& heads, int64_t head_dim,
                            const nn::StackedAdapters& adapters) const override;
  std::shared_ptr<nn::Module> layer_norm(const Shape& shape, double eps) const override;
  Tensor shared_by_parts(const Tensor& parameter) const override;
  void check_decoding(const char* layer) const override;
  const dist::Group& group() const { return group_; }

 private:
  // The input of a split region: all_gathered along the sequence, or its gradient summed.
  Tensor enter(const Tensor& x) const;
  dist::Group group_;
  TensorParallelOptions options_;
};
/// TensorParallelLinears over `group` (shared, for nn::Leaves::linears).
std::shared_ptr<const nn::Linears> tensor_parallel(const dist::Group& group,
                                                   TensorParallelOptions options = {});

/// size / group.size(), raising (naming layer and what) unless it divides.
int64_t piece_of(int64_t size, const dist::Group& group, const char* layer, const char* what);
/// Piece group.rank() of group.size() equal pieces of a whole (unsharded) parameter along
/// axis, as a fresh leaf that carries its Split cut (what sharded checkpoints and
/// gather_state_dict reassemble it by). A layer builds its shards with it from the unsharded
/// layer's initialization.
/// With size >= 0, `full` is a whole padded along axis 0 past its real `size` rows (padded_vocab),
/// the cut records it, and the padding rows are zeroed.
/// across_batches: the group's ranks read different batches (Cut::across_batches).
Tensor split_parameter(const Tensor& full, int axis, const dist::Group& group, int64_t size = -1,
                       bool across_batches = false);
/// Records on `weight`, a layer's piece split along axis 0 over `group`, that the whole is padded
/// past `size` rows (a vocabulary-parallel head built over the padded vocabulary), and zeroes
/// this piece's padding rows.
void record_padding(const Tensor& weight, const dist::Group& group, int64_t size,
                    bool across_batches = false);
/// `whole` with zero rows appended up to `rows` (a vocabulary padded to padded_vocab's size).
Tensor pad_rows(const Tensor& whole, int64_t rows);

/// This rank's shard of an unsharded state dict (the same names), for load_state_dict on the
/// sharded module (a padded vocabulary's rows padded with zeros). Collective-free.
nn::NamedTensors shard_state_dict(const nn::NamedTensors& full, const nn::Module& sharded);

/// The unsharded state dict of a sharded module, on every rank (all_gathers the split
/// parameters over their layers' groups, then drops a padded vocabulary's padding: the state
/// dict of the unsplit model; every rank of those groups must call it).
nn::NamedTensors gather_state_dict(const nn::Module& sharded);

}  // namespace weave::parallel

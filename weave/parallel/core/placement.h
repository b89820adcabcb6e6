#pragma once
// Where a parameter lives across ranks: its placement, one typed fact per parameter, written by
// whatever cuts it and read by whatever must treat its pieces together: clipping, the
// data-parallel wrappers (which ranks average it), sharded checkpoints (which elements of which
// whole tensor it holds) and shard_state_dict (which slice of a whole tensor a rank takes).
//
// A placement is a list of cuts. Each cut says that, over one group, the ranks hold different
// pieces of the parameter:
//   Split      a tensor-parallel layer's slice along an axis (ColumnParallelLinear, ...);
//   FlatShard  a ZeRO-1 or FSDP shard of a flat buffer of several parameters;
//   Experts    ExpertParallelMoE's own range of the experts (each expert is whole on its rank);
//   Stage      a pipeline stage's parameters (the other stages hold others).
// Over every other rank of the world that holds the parameter at all, the copies are identical:
// a parameter without cuts is replicated wherever it exists. So the ranks of a group of size n
// hold each piece n / (product of the cut groups' sizes) times.
//
//   parallel::ColumnParallelLinear fc(784, 256, mesh.tensor());
//   parallel::placement_of(fc.weight)->str();   // "split along axis 0 over group [0, 1]"
//   double norm = parallel::clip_grad_norm_(model.parameters(), 1.0);  // the whole model's
//
// optim::clip_grad_norm_ refuses a parameter with cuts (its rank's norm is not the model's).
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "weave/distributed/distributed.h"
#include "weave/nn/module.h"
#include "weave/tensor/tensor_impl.h"

namespace weave::parallel {

/// A Split cut as a checkpoint records it (no group: the piece and the count): this rank's
/// parameter is piece `index` of `count` equal pieces along `axis`. A whole padded to divide
/// among the ranks (a vocabulary: padded_vocab) has `size` < count x piece along axis 0: the
/// elements past it are padding, in no whole tensor.
struct TensorSplit {
  int axis = -1;
  int index = 0;
  int count = 1;
  int64_t size = -1;  // -1: count x the piece's length
};

namespace detail {
/// A FlatShard cut's layout (ZeRO-1's, FSDP's): elements [begin, begin + numel) of `members`
/// laid out back to back at `offsets`. Members are known by identity; their names and
/// tensor-parallel splits are given (FSDP knows them) or, left empty, looked up in the
/// checkpoint's model (ZeRO-1).
struct FlatShard {
  std::vector<const void*> members;
  std::vector<std::string> names;
  std::vector<TensorSplit> splits;
  std::vector<int64_t> offsets;
  std::vector<Shape> shapes;
  int64_t begin = 0;
};
}  // namespace detail

/// Over `group`, the ranks hold different pieces of a parameter.
struct Cut {
  enum class Kind { Split, FlatShard, Experts, Stage };
  Kind kind = Kind::Split;
  dist::Group group;
  /// Split: the axis cut into group.size() equal pieces, piece group.rank() here.
  int axis = -1;
  /// Split along axis 0 of a whole padded to divide among the ranks (a vocabulary): the whole's
  /// real length, the rows past it padding (gather_state_dict drops them, sharded checkpoints
  /// hold none); -1: no padding.
  int64_t size = -1;
  /// Split over ranks of which some read different batches (a vocabulary split over FSDP's
  /// shard group, tensor_parallel_vocabulary.h): each piece's gradient already sums the batches of
  /// those ranks, so a data-parallel wrapper averages it as it does an expert's (ReplicaGroups):
  /// over the ranks of its group holding the same piece, times 1 / (their share of the group).
  bool across_batches = false;
  /// Experts: this rank holds experts [first, first + count) of `total`. Stage: count 2 marks a
  /// parameter that the first and the last stage both hold (tie_first_and_last_stage), the same
  /// piece twice.
  int64_t first = 0, count = 0, total = 0;
  /// FlatShard: which elements of which members the shard holds (for sharded checkpoints, and
  /// for clipping a shard with tensor-parallel members); null where its writer gives none.
  std::shared_ptr<const detail::FlatShard> layout = nullptr;
  /// "split along axis 1 over group [0, 1]", "experts 2..3 of 4 over group [0, 2]", ...
  std::string str() const;
};

/// Every cut of one parameter, with the advice its writer gives for clipping it.
class Placement final : public PlacementRecord {
 public:
  std::vector<Cut> cuts;
  /// Context parallelism: over this group the ranks hold the same values, but each reads its
  /// part of every sequence, so each holds a partial gradient that a data-parallel wrapper must
  /// add up: the wrapper's group must take these ranks in (mesh.data_and_context()).
  std::optional<dist::Group> context;
  /// Marked by tie_first_and_last_stage: the pipeline built over the stages records a Stage cut
  /// of count 2 (until then no group is known, and the parameter is replicated as far as a
  /// data-parallel wrapper built before the pipeline can tell).
  bool tied_across_stages = false;
  /// How to clip a parameter so placed (the writer's hint, for optim::clip_grad_norm_'s error).
  std::string hint;
  /// Its gradient is summed reproducibly (a data-parallel wrapper's reproducible mode):
  /// clip_grad_norm_ then adds the norm exactly (dist::ExactSum), so the clip is reproducible
  /// too.
  bool reproducible = false;

  bool spread() const override;
  std::string describe() const override;
  /// The cuts, "; "-separated ("replicated" without any).
  std::string str() const;
  /// How many ranks of `group` hold the same piece as this one (group.size() over the product
  /// of the cut groups' sizes, times 2 for a parameter tied across stages); raises unless that
  /// product divides the group's size.
  int copies_in(const dist::Group& group) const;
};

/// Marks `parameter` as one that the first and the last pipeline stage both hold, as GPT-2's
/// last stage holds the token embedding its head multiplies by (Megatron-LM's shared
/// embedding): after each train_step parallel::Pipeline adds the two stages' gradients, so both
/// copies take the same step, and clipping counts it once. Both stages mark their copies, in the
/// same order, before constructing the Pipeline (which records its group); stages between hold
/// none.
void tie_first_and_last_stage(const Tensor& parameter);

/// Marks t's gradient as summed reproducibly (Placement::reproducible).
void mark_reproducible(const Tensor& t);

/// t's placement, or null when nothing cut it (replicated wherever it exists).
const Placement* placement_of(const Tensor& t);
/// Records `cut` on t (a leaf, usually a parameter), beside the cuts of other kinds recorded
/// before; it replaces an earlier cut of its kind (a pipeline rebuilt over other ranks moves
/// its stage). `hint`, when given, replaces the clipping advice.
void add_cut(const Tensor& t, Cut cut, const std::string& hint = "");

/// Records on every parameter of `module` that the ranks of `context` read different parts of
/// every sequence with it (the context-parallel layers and models do it): a data-parallel
/// wrapper over a group that leaves some of them out then raises, naming mesh.data_and_context().
void record_context_reads(const nn::Module& module, const dist::Group& context);

/// Parameter name -> split axis of every parameter of `module` with a Split cut (names as in
/// module.named_parameters()); parameters not listed are not split.
std::map<std::string, int> split_axes(const nn::Module& module);
/// The same with each split's piece and count: what a sharded checkpoint records of every split
/// parameter, so that it loads at another tensor-parallel size.
std::map<std::string, TensorSplit> tensor_splits(const nn::Module& module);

/// Scales the gradients of `params` (this rank's: its slices, shards, experts and stage) so that
/// the norm of the whole model's gradient, over every rank of `group`, is at most max_norm;
/// returns that norm before clipping, the same on every rank. Each parameter's placement says
/// how many ranks of the group hold the same piece, so each piece counts once whatever the mix
/// of data, tensor, expert, pipeline and sharded parameters (one all_reduce). Where a wrapper
/// sums the gradients reproducibly (Placement::reproducible), the norm is summed exactly, so its
/// bits do not depend on how the pieces are spread over the ranks. norm_type is any
/// p >= 1 or INFINITY; with error_if_nonfinite a NaN or infinite norm raises on every rank.
/// Collective over `group` (default: the world), whose ranks together hold the whole model.
double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type = 2.0,
                       const dist::Group& group = dist::world(), bool error_if_nonfinite = false);

namespace detail {
/// The Split cut of every parameter of `module` that has one, by its name in
/// module.named_parameters().
std::map<std::string, Cut> split_parameters(const nn::Module& module);
/// The layout of t's FlatShard cut, or null when it has none (shared, not copied: clipping
/// reads it every step).
std::shared_ptr<const FlatShard> flat_shard_of(const Tensor& t);
/// Drops t's cut of `kind` (a wrapper going away takes its shard's record with it).
void remove_cut(const Tensor& t, Cut::Kind kind);

/// Where a data-parallel wrapper over `group` (ranks that read different batches) reduces each
/// parameter's gradient, read from the placements. A parameter without cuts inside `group` is
/// averaged over all of it; an expert spread over ranks of `group` (an Experts cut within it) is
/// summed over the ranks holding the same experts (its expert-data group) and divided by
/// group.size(): its gradient already sums the tokens of its expert group, so this is the
/// average over the expert-data group times 1 / (expert group size), Megatron's expert scale.
/// A vocabulary piece split across batches (a Split cut with across_batches) is reduced alike
/// over the ranks of `group` holding the same piece (each rank alone under plain FSDP).
struct ReplicaGroups {
  /// groups[0] is the wrapper's group; the others are its expert-data groups.
  std::vector<dist::Group> groups;
  /// Per parameter, its entry in `groups`.
  std::vector<int> of;
  /// Of each group past the first: whether it gathers the holders of vocabulary pieces split
  /// across batches (else of experts). vocabulary[0] is false.
  std::vector<bool> vocabulary;
  /// What an average over groups[k] is multiplied by: groups[k].size() / groups[0].size().
  double scale(int k) const;
  /// The parameters of `params` (the list `of` describes) averaged over groups[k].
  std::vector<Tensor> members(const std::vector<Tensor>& params, int k) const;
};
/// Reads the placements of `params` (named `names`, the same on every rank) and creates the
/// expert-data groups (split_group of `group`, one per distinct way experts are spread). Raises
/// on every rank, tagged `op`, when a parameter is cut by a tensor-parallel split, a flat shard
/// or a pipeline stage across ranks of `group` (those ranks hold different pieces of the same
/// batch's gradient: the group must be the data-parallel one), or by experts spread partly
/// outside it. Collective over `group`.
ReplicaGroups replica_groups(const std::vector<std::string>& names,
                             const std::vector<Tensor>& params, const dist::Group& group,
                             const char* op);

/// What a wrapper that averages every parameter over all of `group` needs (ZeRO-1,
/// DistributedOptimizer, decentralized training): a copy of each parameter on each rank of it.
/// Raises on every rank, tagged `op`, naming the first parameter (`names[i]`, or "parameter i"
/// without names) that is cut across the group as replica_groups refuses, or that is one of the
/// experts spread over it (their copies differ: averaging them would mix different experts),
/// with `hint` (what trains them). Collective over `group`: one agreement.
/// check_replicated's hint for the wrappers that average every parameter over their group.
inline constexpr const char* kTrainExpertsHint =
    "train spread experts under DistributedDataParallel or FullyShardedDataParallel, which "
    "average each expert over the ranks that hold it (its expert-data group)";
void check_replicated(const std::vector<std::string>& names, const std::vector<Tensor>& params,
                      const dist::Group& group, const char* op, const std::string& hint);

/// Whether p is one of the experts spread over ranks of `group` (an Experts cut of more than one
/// rank, inside the group): its copies on the group's ranks differ, and so does its name.
bool spread_expert_in(const Tensor& p, const dist::Group& group);
/// Whether p's copies on the ranks of `group` differ: one of the experts spread over them, or a
/// vocabulary piece split across their batches (Cut::across_batches).
bool spread_piece_in(const Tensor& p, const dist::Group& group);
}  // namespace detail

}  // namespace weave::parallel

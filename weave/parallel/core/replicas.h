#pragma once
// Keeping replicas equal: what every data-parallel strategy does to the copies of a model (or of
// an optimizer's state) that the ranks of a group hold.
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "weave/distributed/distributed.h"
#include "weave/nn/module.h"
#include "weave/optim/optimizer.h"
#include "weave/parallel/core/placement.h"

namespace weave::parallel {

namespace detail {
class Verdict;
}

/// Builds the optimizer of a strategy's own tensors (a rank's flat slice, a replica's
/// parameters), e.g.
/// `[](std::vector<Tensor> shard) { return std::make_unique<optim::Adam>(shard, {...}); }`.
using OptimizerFactory = std::function<std::unique_ptr<optim::Optimizer>(std::vector<Tensor>)>;

/// Broadcasts a module's parameters and buffers from group rank `root` (Horovod's
/// broadcast_parameters), so every replica starts equal. Collective over the group: first a
/// checksum agreement (8 bytes a tensor), so that only the tensors some rank holds otherwise
/// travel (replicas built alike send nothing), packed in flat buckets of at most 25 MB (per
/// dtype and device), all in flight at once. Device tensors are always sent.
void broadcast_parameters(nn::Module& module, int root = 0,
                          const std::optional<dist::Group>& group = std::nullopt);

/// Draws a deferred model whose parameters are cut over ranks (tensor-parallel slices, experts)
/// as nn::materialize does, once the ranks holding its other pieces agreed on its DeferredInit
/// seed: a rank built with another seed raises on every rank, naming both seeds, where
/// nn::materialize alone would leave a model no layout holds. Collective over every group that
/// cuts a parameter (a few small messages). The data-parallel wrappers and pipelines make the
/// same agreement themselves.
///
///   { nn::DeferredInit deferred(seed); model = make_model(models::ModelSplit::from_mesh(mesh)); }
///   parallel::materialize(*model);          // tensor-parallel only: no wrapper draws it
void materialize(nn::Module& module);

/// Raises weave::Error on every rank of the group, naming the first difference, unless every
/// rank's module has the same parameter and buffer names, shapes and dtypes. Collective.
void check_same_model(const nn::Module& module,
                      const std::optional<dist::Group>& group = std::nullopt);

/// Broadcasts an optimizer's state tensors and learning rate from group rank `root`, so a
/// restarted or late replica continues exactly like the others. Every rank's optimizer must
/// have created the same state so far (raises on every rank otherwise). Collective.
void broadcast_optimizer_state(optim::Optimizer& optimizer, int root = 0,
                               const std::optional<dist::Group>& group = std::nullopt);

/// Averages the gradients of `params` over the group in buckets of at most bucket_mb, as
/// DistributedOptimizer::average_gradients does. Collective.
void average_gradients(const std::vector<Tensor>& params, const dist::Group& group,
                       double bucket_mb = 25.0, std::optional<DType> compress = std::nullopt);
/// Replaces each tensor by its average over the group, in place, packed into flat buckets of
/// at most bucket_mb whose all_reduces are all in flight at once. Collective.
void average_tensors(const std::vector<Tensor>& tensors, const dist::Group& group,
                     double bucket_mb = 25.0, std::optional<DType> compress = std::nullopt);

/// The net under every layout: raises weave::Error on every rank of the group, naming the
/// parameter and the ranks on each side, unless every copy of each parameter piece is equal to
/// the bit. Which ranks hold copies of the same piece comes from each parameter's placement
/// (placement.h): ranks at the same place in every cut group (the same tensor-parallel slice,
/// experts, shard, pipeline stage) of a parameter of the same name. Returns how many pieces
/// had copies on two or more ranks. Collective: one all_gather of a checksum per parameter.
///
///   if (step % 100 == 0) parallel::check_replicas(model);  // replicas drifted? say which
int64_t check_replicas(const nn::Module& module, const dist::Group& group = dist::world());

namespace detail {
/// check_replicas' comparison, without raising, of value(p) for each parameter p (its values,
/// or its gradient; an undefined value is skipped): the first piece (in name order) whose copies
/// differ, with the ranks on each side ("ranks [0, 2] hold checksum 1a2b3c4d; ranks [1, 3] ..."),
/// or an empty `parameter` when every copy is equal; and how many pieces had copies on two or
/// more ranks. Collective: one all_gather of a checksum per parameter.
struct CopiesCompared {
  int64_t checked = 0;
  std::string parameter, sides;
};
CopiesCompared compare_copies(const nn::Module& module, const dist::Group& group,
                              const std::function<Tensor(const Tensor&)>& value);
/// Broadcasts `tensors` from group rank `root` in flat buckets of at most 25 MB, all in flight
/// at once (broadcast_parameters' transport). Collective.
void broadcast_packed(const std::vector<Tensor>& tensors, int root, const dist::Group& group);
/// Makes every replica equal, reading placements: from group rank `root` of replicas.groups[0]
/// the module's buffers and every parameter but the spread experts (frozen ones too); each
/// spread expert of `params` from the first rank of its expert-data group; what is equal
/// already (broadcast_parameters' checksum agreement) or deferred stays. Collective.
void broadcast_replicas(nn::Module& module, const std::vector<Tensor>& params,
                        const ReplicaGroups& replicas, int root);
/// check_same_model over `group`, with errors tagged `op`.
void check_same_model(const nn::Module& module, const dist::Group& group, const char* op);
/// What check_same_model compares: a line per parameter and buffer; with_seeds adds each
/// deferred parameter's DeferredInit seed (replicas that draw their own values must agree).
std::vector<std::string> model_lines(const nn::Module& module, const dist::Group& group,
                                     bool with_seeds);

/// The DeferredInit seeds `params` are or were drawn with, ascending ("7"; "" when none is:
/// values drawn eagerly or loaded).
std::string init_seeds(const std::vector<Tensor>& params);
/// Notes in `verdict` when two ranks of `group` hold parameters drawn from different seeds
/// (init_seeds of each rank's; ranks with none are left out), then shares the verdict over the
/// group. Collective.
void agree_on_seeds(const std::string& seeds, const dist::Group& group, Verdict& verdict);
/// agree_on_seeds over each group that cuts a parameter of `module` (tensor-parallel splits,
/// then experts; each group once), so that a rank's pieces come from the same draws as the
/// pieces beside them. Collective over those groups.
void agree_on_seeds_over_cuts(const nn::Module& module, Verdict& verdict);
/// A data-parallel wrapper's construction over `group` before it draws the model (DDP, the
/// decentralized wrapper): the seeds agreed over the cut groups and the model over `group`,
/// all ranks raising together; then nn::materialize. Collective.
void materialize_replicas(nn::Module& module, const dist::Group& group, const char* op);
}  // namespace detail

}  // namespace weave::parallel

#pragma once
// A one-call check of a trainer's own wiring, the first thing to run after wiring a new layout.
// parallel::verify_layout builds the model twice in float64 under one nn::DeferredInit seed:
// this rank's part of it in the mesh, wrapped, fed, normalized and clipped as the recipe (the
// trainer's own callables) says, and the whole model on this process alone. It runs one
// forward, backward, clip and optimizer step of both on one global batch (the layout on each
// rank's share of it, one process on all of it) and compares what the layout holds, put
// together whole, with one process: the parameters it starts from, the inputs each rank read,
// the loss, every gradient (and whether the ranks holding copies of one agree), the norm, and
// the parameters after the step. It passes, with the largest relative difference, or names the
// first quantity that diverges and the seam that most likely caused it:
//
//   seam                what went wrong
//   initialization      a parameter starts from other values than one process's (drawn outside
//                       nn::DeferredInit, or from another generator)
//   sampler group       ranks that must read the same rows (tensor, pipeline peers) read others,
//                       or the data ranks' shares do not cover the global batch exactly once
//   sequence layout     each rank's part of every sequence cut otherwise than its attention reads
//                       it (context parallelism)
//   loss normalization  the layout's loss, and its gradients, are another multiple of the mean
//   auxiliary loss      routers' gradients differ (and what feeds them), the last mixture's
//                       experts' agree: a mixture of experts' load-balancing loss skipped, or
//                       counted over other tokens than one process's
//   replicate group     ranks holding copies of one piece hold different gradients: averaged over
//                       other ranks than those that read the batch (HSDP's replicate_group,
//                       mesh.data_and_context())
//   clip group          the gradients agree, the norm does not: clipped over other ranks than
//                       those that together hold the whole model
//   optimizer           gradients and norm agree, the step does not: its parameters, groups or
//                       options differ from one process's
//   precision           the loss or a gradient agrees to float32's rounding only (under 1e-5):
//                       a mixed-precision policy or a float32 tensor in the float64 check
// A step of the layout that raises weave::Error is reported too, with the seam of the step that
// raised (the wrapper: replicate group; the optimizer: optimizer; ...) and its message.
//
//   parallel::ProcessMesh mesh({.data = 2, .tensor = 2});
//   const models::LlamaOptions small{.vocab = 64, .dim = 16, .layers = 2,
//                                    .block = {.heads = 2, .kv_heads = 1, .hidden = 32}};
//   parallel::LayoutRecipe recipe{
//       .model = [&](const parallel::ProcessMesh* mesh) -> std::shared_ptr<nn::Module> {
//         return std::make_shared<models::Llama>(
//             small, mesh ? models::ModelSplit::from_mesh(*mesh) : models::ModelSplit{});
//       },
//       .loss = [](const Tensor& logits, const Tensor& targets, const parallel::ProcessMesh* mesh)
//       {
//         return (mesh ? models::ModelSplit::from_mesh(*mesh) : models::ModelSplit{})
//             .cross_entropy(logits, targets);
//       }};
//   Tensor tokens = randint(0, 64, {8, 9}, {.dtype = kInt64}, &generator);  // the same everywhere
//   parallel::LayoutReport report = parallel::verify_layout(
//       mesh, recipe, {.inputs = tokens.narrow(1, 0, 8), .targets = tokens.narrow(1, 1, 8)});
//   if (dist::rank() == 0) std::printf("%s\n", report.str().c_str());
//
// The recipe's callables are the trainer's own code, given the mesh (null: the whole model on
// one process, where they must run no collective). Build a shrunken copy (a few layers, small
// dimensions): the check holds everything twice and runs in seconds at 4 ranks. Mixed precision
// has no place in it: the model runs in float64 so that every correct layout agrees to 1e-10.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "weave/nn/module.h"
#include "weave/optim/optimizer.h"
#include "weave/parallel/core/data_parallel_wrapper.h"
#include "weave/parallel/core/mesh.h"

namespace weave::parallel {

/// One global batch, the same on every rank: the model's inputs (a [B, ...] main input, and
/// positions and document ids where the model reads them) and the targets [B, ...].
struct LayoutBatch {
  nn::Inputs inputs;
  Tensor targets;
};

/// A trainer's wiring. Each callable receives the mesh (its layout), or null for the whole model
/// on one process (the reference). Unset ones take the defaults below.
struct LayoutRecipe {
  /// The model: the whole one for a null mesh, else this rank's part of it in the mesh (its
  /// tensor-parallel slices, pipeline stage, experts). Called inside an nn::DeferredInit scope,
  /// then moved to float64. Required.
  std::function<std::shared_ptr<nn::Module>(const ProcessMesh* mesh)> model;
  /// The data-parallel wrapper over this rank's part. Default: parallel::data_parallel(part,
  /// mesh) (DDP over the data x context ranks, or the part itself on one replica).
  std::function<std::unique_ptr<DataParallelWrapper>(nn::Module& part, const ProcessMesh& mesh)>
      wrap;
  /// This rank's share of the global batch (the sampler and the sequence cut). Default: data rank
  /// d's contiguous block of rows (the rows divide evenly), then under context parallelism its
  /// part of every sequence (shard_sequence along axis 1 in the zig-zag layout) of the main
  /// input, positions, document ids and targets.
  std::function<LayoutBatch(const LayoutBatch& whole, const ProcessMesh& mesh)> shard;
  /// The loss of the model's output against the targets (this rank's share, or the whole
  /// batch's for a null mesh): the mean the layout's ranks average over the data x context ranks
  /// (parallel::replica_mean). Default: cross_entropy over the flattened tokens.
  std::function<Tensor(const Tensor& output, const Tensor& targets, const ProcessMesh* mesh)> loss;
  /// The optimizer: over `wrapper`'s trained tensors at the layout, over `model`'s parameters on
  /// one process (wrapper null). Default: AdamW (lr 1e-2) over optim::weight_decay_groups(model,
  /// 0.1), through wrapper->param_groups at the layout.
  std::function<std::unique_ptr<optim::Optimizer>(nn::Module& model, DataParallelWrapper* wrapper)>
      optimizer;
  /// Clipping at the layout: the norm of `params` (the wrapper's trained tensors) before
  /// clipping. Default: parallel::clip_grad_norm_(params, max_norm) over the world. One process
  /// clips with optim::clip_grad_norm_.
  std::function<double(const std::vector<Tensor>& params, double max_norm)> clip;
  /// For an optimizer that averages the gradients in its own step (ZeroRedundancyOptimizer,
  /// DistributedOptimizer), under a wrap that averages nothing (DataParallelOptions::
  /// optimizer_averages): built over this rank's part, it gives the step, which averages, clips
  /// to max_norm and steps, returning the norm before clipping. It takes the place of
  /// `optimizer` and `clip` at the layout (one process still uses those). The gradients are then
  /// averaged inside the step, so the check compares the loss, the norm and the parameters after
  /// the step, but not the gradients.
  std::function<std::function<double()>(nn::Module& part, const ProcessMesh& mesh)>
      averaging_optimizer;
  double max_norm = 1.0;
  /// Micro-batches of a pipeline's step (MeshShape::pipeline > 1); they divide a rank's rows.
  int microbatches = 2;
  /// The nn::DeferredInit seed both models are drawn from.
  uint64_t seed = 0;
  /// Largest relative difference that passes (max |layout - one process| / max |either| per
  /// tensor).
  double tolerance = 1e-10;
};

/// What verify_layout found, the same on every rank.
struct LayoutReport {
  bool passed = false;
  /// The largest relative difference over everything compared.
  double largest_difference = 0;
  /// The first quantity that diverged ("the loss", "the gradient of blocks.0.attention.wq.weight",
  /// "the inputs", "the parameter x after the step", "the wrapper (raised)"); "" when passed.
  std::string diverged;
  /// Its relative difference (0 for what is not a number: inputs, a raised step).
  double difference = 0;
  /// The seam that most likely caused it (the table above); "" when passed.
  std::string seam;
  /// The evidence and a hint (or the message of a step that raised).
  std::string detail;
  /// How many tensors were compared (parameters before and after the step, gradients).
  int64_t compared = 0;
  /// "layout passed: ... (largest relative difference 3.1e-16)" or
  /// "layout diverged at <diverged> (relative difference ...); likely seam: <seam>: <detail>".
  std::string str() const;
};

/// Runs the recipe at `mesh` and on one process, one step each on `batch` (see above), and
/// compares them. Never raises for the layout's own faults (they are the report); raises for a
/// recipe without a model or for faults of the one-process reference (a bug of the model
/// itself). Collective over the world; every rank returns the same report.
LayoutReport verify_layout(const ProcessMesh& mesh, const LayoutRecipe& recipe,
                           const LayoutBatch& batch);

}  // namespace weave::parallel

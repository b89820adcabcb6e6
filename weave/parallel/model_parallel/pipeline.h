#pragma once
// Pipeline parallelism: consecutive layers on consecutive ranks (stages); a batch is cut into
// micro-batches that flow through the stages, activations forward and gradients back. Where a
// schedule step sends to a peer and receives from one, the two go as one grouped exchange
// (pipeline_link.h), so no schedule waits in a circle of sends: it holds on NCCL, whose send
// alone completes only once it is matched, as on MPI.
//
//   nn::Sequential model{...};                               // the whole model, every rank
//   auto stage = parallel::pipeline_stage(model, dist::rank(), dist::world_size());
//   parallel::Pipeline pipe(*stage, {.schedule = parallel::Schedule::OneFOneB,
//                                    .microbatches = 8});
//   optim::Adam opt(stage->parameters());
//   opt.zero_grad();
//   Tensor loss = pipe.train_step(x, y, [](const Tensor& out, const Tensor& target) {
//     return cross_entropy(out, target);
//   });                                                     // defined on the last stage
//   opt.step();
//
// Schedules (p stages, m micro-batches; a stage idles (p - 1) / (m + p - 1) of a step when
// the stages are balanced):
//   GPipe: every forward, then every backward; m micro-batches of activations alive.
//   1F1B:  p - s - 1 warm-up forwards on stage s, then one forward and one backward in turn;
//          at most p - s micro-batches of activations alive.
// Interleaved (virtual stages, Megatron-LM): each rank holds v chunks of the model, chunk c of
// rank r being stage c p + r of v p, so a micro-batch visits every rank v times; with 1F1B the
// bubble shrinks to (p - 1) / (v m + p - 1), with 2 (p - s - 1) + (v - 1) p warm-up forwards
// on stage s. Pass the chunks to the vector constructor (pipeline_chunks cuts them); m must then
// divide by p. The interleaved schedules, and predict, run on a clock all stages keep: each tick
// every stage runs its units and exchanges with both neighbours what they produced at that tick,
// so every exchange pairs with ones of the same tick.
// Every stage runs every micro-batch's backward (a stage with no loss too), in the same order,
// with pending-node replay off. Shapes travel with the data: a stage need not know its input
// shape.
//
// Data parallelism inside each stage: pass the stage's data-parallel wrapper (DDP over the ranks
// holding the same stage, e.g. mesh.data()) instead of the stage. Every micro-batch but the
// last runs under its no_sync(); the last one's backward averages what all of them accumulated,
// the wrapper's buckets launched while that backward goes on (Megatron-LM's overlap):
//
//   parallel::ProcessMesh mesh({.data = 2, .tensor = 2, .pipeline = 2});    // 8 ranks
//   parallel::DistributedDataParallel ddp(*stage, {.group = mesh.data()});
//   parallel::Pipeline pipe(ddp, {.microbatches = 4, .group = mesh.pipeline()});
//   pipe.train_step(x, y, loss);                  // gradients averaged over mesh.data()
//   parallel::clip_grad_norm_(stage->parameters(), 1.0);   // the whole model's norm
//
// A fully sharded stage goes the same way (FullyShardedDataParallel over mesh.data(); the
// optimizer and the clipping take fsdp.parameters(), the shards, which carry the stage too).
// Its micro-batches accumulate whole gradients under no_sync() until the last one
// reduce-scatters them; reshard_after_forward = false keeps each unit gathered across them
// (torchtitan's choice under pipelining), trading memory for a gather per micro-batch.
#include <functional>
#include <memory>
#include <vector>

#include "weave/distributed/distributed.h"
#include "weave/nn/layers.h"
#include "weave/parallel/core/data_parallel_wrapper.h"

namespace weave::parallel {

enum class Schedule { GPipe, OneFOneB };

/// "gpipe" or "1f1b" (an error names the choices otherwise).
Schedule schedule_from_name(const std::string& name);

struct PipelineOptions {
  Schedule schedule = Schedule::OneFOneB;
  /// Micro-batches per step; the batch size must divide by it.
  int microbatches = 1;
  /// The stages in order (stage s is group rank s); unset: the world.
  std::optional<dist::Group> group = std::nullopt;
};

/// The loss of one micro-batch's output on the last stage (a scalar).
using PipelineLoss = std::function<Tensor(const Tensor& output, const Tensor& target)>;

/// What the last train_step did on this stage.
struct PipelineStats {
  /// Most micro-batches whose forward had run and backward had not (their graphs alive).
  int peak_live_microbatches = 0;
  /// Seconds of the step, and seconds spent waiting to receive activations or gradients.
  double step_s = 0, waiting_s = 0;
  double idle_fraction() const { return step_s > 0 ? waiting_s / step_s : 0; }
};

class Pipeline {
 public:
  /// `stage` is this rank's part of the model (it must outlive the pipeline). Every stage of
  /// the group constructs one with the same options.
  Pipeline(nn::Module& stage, PipelineOptions options = {});
  /// Interleaved: this rank's chunks in model order (chunk c is virtual stage c p + r); every
  /// rank passes the same number.
  Pipeline(std::vector<nn::Module*> chunks, PipelineOptions options = {});
  /// The stage wrapped for data parallelism: the wrapper's group must meet the pipeline group
  /// in this rank alone (it holds this stage on other data-parallel ranks), or construction
  /// raises on every stage.
  Pipeline(DataParallelWrapper& stage, PipelineOptions options = {});

  /// Forward and backward of every micro-batch. inputs.x [B, ...] matters on the first stage,
  /// targets [B, ...] on the last (others may pass undefined tensors). Side inputs (positions
  /// and document ids of a packed batch, [B, T] or [T]) reach every stage's forward with its
  /// activation, each micro-batch its rows: every stage passes them, as Megatron-LM's stages
  /// read them from the batch. Gradients accumulate into the stage's parameters, averaged over
  /// micro-batches (the loss is the mean of the micro-batch losses). Returns that mean loss on
  /// the last stage, undefined elsewhere. Returns once this stage's sends are complete. A
  /// stage's wrapper built with check_finite that finds NaN or infinity in the step's averaged
  /// gradients lets the schedule finish; then every rank of every stage raises, and the step
  /// can be skipped (zero_grad) and the next one trained, as without a pipeline.
  Tensor train_step(const nn::Inputs& inputs, const Tensor& targets, const PipelineLoss& loss);

  /// Forward only, without a graph: the outputs [B, ...] on the last stage, undefined
  /// elsewhere (evaluation; in micro-batches of the same size). The micro-batches' outputs are
  /// joined along `output_batch_dim` (1 for a sequence-first model's [T, B, ...]). A model
  /// whose output holds k times a micro-batch's rows, rank block by rank block (every batch
  /// rank's rows: a vocabulary split over the shard group, ModelSplit::vocabulary), is joined
  /// block by block, [k B, ...]: block j holds rank j's rows of every micro-batch, as one
  /// forward over the whole batch gives them.
  Tensor predict(const nn::Inputs& inputs, int output_batch_dim = 0);

  /// This rank's place in the pipeline group, and the group's size.
  int stage() const { return group_.rank(); }
  int stages() const { return group_.size(); }
  /// Whether this rank feeds the inputs / computes the loss.
  bool is_first() const { return stage() == 0; }
  bool is_last() const { return stage() == stages() - 1; }
  const PipelineStats& stats() const { return stats_; }

 private:
  // One chunk per rank: each boundary's send paired with the receive from the same peer
  // (detail::StageLink), safe where a send alone waits for its receive (NCCL).
  Tensor train_linked(const std::vector<Tensor>& in, const std::vector<Tensor>& target,
                      const PipelineLoss& loss);
  // Virtual stages (Megatron-LM's interleaving): each step's sends and receives, both ways, as
  // one grouped exchange.
  Tensor train_interleaved(const std::vector<Tensor>& in, const std::vector<Tensor>& target,
                           const PipelineLoss& loss);
  bool holds_last_stage(int chunk) const { return is_last() && chunk == int(chunks_.size()) - 1; }
  Pipeline(std::vector<nn::Module*> chunks, std::vector<DataParallelWrapper*> wrappers,
           PipelineOptions options);
  // A micro-batch's forward and backward on one chunk; through the chunk's data-parallel
  // wrapper if it has one, all but the last micro-batch without synchronizing.
  Tensor forward_chunk(int chunk, int micro, const Tensor& x);
  void backward_chunk(int chunk, int micro, const Tensor& y, const std::vector<Tensor>& grad_y);

  // Cuts this step's side inputs into its micro-batches (every stage holds them).
  void set_side_inputs(const nn::Inputs& inputs);
  // The stages hold pieces of one model: drawn (or deferred) with one DeferredInit seed, or
  // every stage raises.
  void agree_on_seed();
  // Records each parameter's stage, finds the tied ones (agreed with the other stages: the
  // first and the last hold as many, the others none) and groups the two stages holding them.
  void place_parameters();
  // Adds the first and the last stage's gradients of each tied parameter.
  void sum_tied_gradients();
  // Raises on every stage when a stage's wrapper found NaN or infinity in this step's averaged
  // gradients (nonfinite_: its error); else whether any stage attached side losses (this one:
  // `attached`). Collective: one agreement.
  bool raise_if_any_stage_nonfinite(bool attached);
  std::vector<nn::Module*> chunks_;
  std::vector<DataParallelWrapper*> wrappers_;  // per chunk, null without one
  std::vector<Tensor> positions_, documents_;   // this step's, per micro-batch (or none)
  PipelineOptions options_;
  dist::Group group_;
  PipelineStats stats_;
  std::vector<Tensor> tied_;  // this stage's parameters tied across the first and last stage
  dist::Group tied_group_;    // the first and the last stage (when anything is tied)
  std::string nonfinite_;     // this step's error of a wrapper that found NaN or infinity
};

/// Stage `stage` of `stages` of a Sequential, as a Sequential sharing its layers: contiguous
/// slices balanced by parameter count, or cut before the given child indices (stages - 1
/// increasing boundaries).
std::shared_ptr<nn::Sequential> pipeline_stage(const nn::Sequential& model, int stage, int stages,
                                               const std::vector<size_t>& boundaries = {});

/// Rank `rank`'s chunks of an interleaved pipeline of `ranks` ranks with `virtual_stages`
/// chunks each: stages rank, rank + ranks, rank + 2 ranks, ... of ranks * virtual_stages.
std::vector<std::shared_ptr<nn::Sequential>> pipeline_chunks(const nn::Sequential& model, int rank,
                                                             int ranks, int virtual_stages);

}  // namespace weave::parallel

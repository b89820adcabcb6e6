#pragma once
// Dynamic loss scaling for float16 (and bfloat16) training: the loss is multiplied by a large
// scale before backward so that small gradients do not flush to zero in float16, the gradients
// are divided by it before the step, and a step whose gradients hold inf or NaN is skipped.
//
//   parallel::GradScaler scaler;                         // over the world when dist is up
//   for (auto& batch : loader) {
//     Tensor loss;
//     {
//       AutocastGuard autocast(kFloat16);
//       loss = cross_entropy(ddp(batch.input), batch.target);
//     }
//     scaler.scale(loss).backward();
//     scaler.unscale_(opt.params());                    // optional: before clipping
//     optim::clip_grad_norm_(opt.params(), 1.0);
//     scaler.step(opt);                                 // skipped on every rank on inf/NaN
//     scaler.update();
//     opt.zero_grad();
//   }
//
// The schedule: the scale starts at init_scale; a step with inf/NaN gradients is skipped and
// multiplies the scale by backoff_factor; growth_interval clean steps in a row multiply it by
// growth_factor. Under data parallelism every rank must skip the same steps and keep the same
// scale, or the replicas diverge (or a rank waits in a collective its peers skipped): the
// verdict is agreed over `group` with one all_reduce per step (each rank's "found inf" and
// "has no gradients" flags, maxed), so one rank's overflow skips the step everywhere. The same
// all_reduce compares the scales and growth trackers: ranks that hold different ones (built
// with other options, restored from different states) raise on every rank. When every step
// of a long run is skipped, the scale only shrinks; a warning says so.
//
// It composes with every data-parallel wrapper, since unscaling (a division) commutes with
// averaging: DDP (unscale_ checks the averaged gradients after backward), DistributedOptimizer
// and ZeRO (step(params, [&] { zero.step(); }) unscales the local gradients, agrees, then runs
// the wrapper's step, which averages), and DecentralizedDataParallel (its `scaler` option:
// each bucket is unscaled and checked before its optimizer steps it inside backward; a bucket
// with inf/NaN is not stepped on that rank, and update() agrees over the world).
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "weave/distributed/distributed.h"
#include "weave/optim/optimizer.h"

namespace weave::parallel {

struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  /// false: scale() returns the loss, nothing is checked, step() just steps (one code path
  /// for float32 and float16 runs).
  bool enabled = true;
  /// Warn (once per run of skips, on the group's rank 0) when this many steps in a row were
  /// skipped: the gradients are then NaN for a reason no scale fixes. 0: never.
  int64_t warn_after_skipped = 100;
  /// The ranks that agree on each verdict: every rank whose gradients the step uses (default:
  /// the world when dist::init() ran, else this process alone). Under tensor or pipeline
  /// parallelism keep the world: each shard can overflow on its own.
  std::optional<dist::Group> group = std::nullopt;
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});
  /// Gives back the attached losses' factor if scale() set it and no update() followed.
  ~GradScaler();
  GradScaler(const GradScaler&) = delete;
  GradScaler& operator=(const GradScaler&) = delete;

  /// loss * scale (recorded, so backward carries the scale into every gradient); until update()
  /// (or this scaler's end), losses attached to activations (attach_loss: experts' balancing)
  /// take the scale too. A disabled scaler leaves them alone.
  Tensor scale(const Tensor& loss) const;
  /// Divides the gradients of `params` by the scale in place and agrees over the group whether
  /// any rank's hold inf or NaN (one all_reduce). At most once per step; step() calls it if
  /// you did not. Raises on every rank when any rank has no gradients at all (backward of the
  /// scaled loss did not run). Collective.
  void unscale_(const std::vector<Tensor>& params);
  /// Unscales (if not yet), then runs optimizer.step() unless the gradients held inf/NaN on
  /// any rank. Returns whether it stepped (the same on every rank). Collective.
  bool step(optim::Optimizer& optimizer);
  /// The same for a wrapper's step (DistributedOptimizer, ZeRO): unscales `params`' local
  /// gradients, agrees, then calls run_step unless skipped. Collective.
  bool step(const std::vector<Tensor>& params, const std::function<void()>& run_step);
  /// Adjusts the scale by this step's verdict; raises if no step or unscale_ ran since the
  /// last update (a scaler used without backward).
  void update();

  double get_scale() const { return scale_; }
  /// Clean steps since the last change of the scale.
  int64_t growth_tracker() const { return growth_tracker_; }
  /// Steps skipped in a row, up to the last update().
  int64_t skipped_in_a_row() const { return skipped_in_a_row_; }
  bool enabled() const { return options_.enabled; }

  /// For DecentralizedDataParallel: unscales one bucket's local gradients and returns whether
  /// they are finite; remembers an overflow for update(), which then agrees over the group.
  bool unscale_local(const std::vector<Tensor>& grads);

  /// "scale" and "growth_tracker", for checkpoints.
  std::map<std::string, double> state_dict() const;
  /// Raises (changing nothing) unless both entries are there, the scale finite and > 0.
  void load_state_dict(const std::map<std::string, double>& state);

 private:
  enum class Stage { Ready, Unscaled, Stepped };
  // Agrees over the group on whether any rank found inf/NaN (after running `checks`), and
  // raises on every rank unless all hold the same scale and growth tracker.
  bool agree_verdict(bool found_inf, const std::function<void()>& checks, const char* op) const;
  void warn_if_always_skipped();
  GradScalerOptions options_;
  std::optional<dist::Group> group_;
  double scale_;
  mutable bool factor_set_ = false;  // scale() set the attached losses' factor
  int64_t growth_tracker_ = 0;
  Stage stage_ = Stage::Ready;
  bool found_inf_ = false;
  bool agreed_ = false;  // found_inf_ is the group's verdict (else this rank's alone)
  int64_t skipped_in_a_row_ = 0;
  double scale_before_skips_ = 0;
};

}  // namespace weave::parallel

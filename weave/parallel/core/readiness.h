#pragma once
// Which gradients of one backward are in (internal): every data-parallel strategy launches a
// bucket's collective the moment the bucket's last gradient is accumulated, in one fixed bucket
// order on every rank, and cuts its buckets from the order the first backward produced them in.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "weave/distributed/distributed.h"

namespace weave::parallel::detail {

/// One backward's bookkeeping over parameters partitioned into buckets: a post-accumulate-grad
/// hook on every parameter marks it ready; when a bucket's parameters are all ready and every
/// bucket before it has been launched, `launch(b)` runs. Launching in a fixed bucket order is
/// what keeps the collectives of every rank paired. Before the buckets are set, the hooks trace
/// the order parameters become ready in (the owner cuts buckets from it after the first
/// backward). `finish(failed)` runs when backward ends, also when an exception unwinds it.
class GradReadiness {
 public:
  struct Handlers {
    /// Parameter i's gradient was accumulated (before its bucket is counted down).
    std::function<void(int param)> ready = {};
    std::function<void(int bucket)> launch = {};
    std::function<void(bool failed)> finish = {};
  };
  /// Installs the hooks (on the parameters that require grad; a frozen one is never ready and
  /// belongs in no bucket); they do nothing once the returned object is gone.
  static std::shared_ptr<GradReadiness> create(const std::vector<Tensor>& params,
                                               Handlers handlers);
  ~GradReadiness();
  GradReadiness(const GradReadiness&) = delete;
  GradReadiness& operator=(const GradReadiness&) = delete;

  /// The buckets, in launch order; the last `held_back` are launched only by launch_rest().
  /// Parameters already marked ready (in the traced backward) stay ready; nothing launches
  /// until the next mark or launch_rest().
  void set_buckets(std::vector<std::vector<int>> buckets, int held_back = 0);
  bool has_buckets() const { return !buckets_.empty(); }
  const std::vector<std::vector<int>>& buckets() const { return buckets_; }
  int bucket_of(int param) const { return bucket_of_[size_t(param)]; }
  /// The order parameters became ready in since the last take (the first backward's trace).
  std::vector<int> take_trace();

  /// While paused (no_sync, gradient accumulation) the hooks do nothing.
  void set_paused(bool paused) { paused_ = paused; }
  bool paused() const { return paused_; }
  bool is_ready(int param) const { return ready_[size_t(param)] != 0; }
  int64_t ready_count() const { return ready_count_; }
  /// Parameters marked ready when the first bucket was launched (-1: none launched yet).
  int64_t ready_at_first_launch() const { return ready_at_first_launch_; }

  /// Starts a step afresh outside backward: nothing ready, nothing launched (a step settled
  /// without a backward, or shadowed by join()).
  void clear();
  /// Called as the owner's forward starts, before it communicates; returns whether this forward
  /// synchronizes (grad mode on, not paused). If the previous synchronizing forward got no
  /// backward on this rank (it failed before reaching the model, or was skipped: its output's
  /// graph is gone), warns (the first time only), naming `owner` and `step`, and settles that step
  /// first as failed (finish(true)): the owner then issues what its peers' backward issued, so
  /// their collectives pair with this rank's.
  bool begin_forward(const char* owner, int64_t step);
  /// The part of begin_forward that settles a step whose synchronizing forward got no backward
  /// on this rank (warning, then finish(true)); nothing when no step is pending. join() calls it
  /// when the loop raised between a forward and its backward.
  void settle_skipped_backward(const char* owner, int64_t step);
  /// A synchronizing forward ran: its step is pending until finish() runs for it.
  void expect_backward() { backward_expected_ = true; }
  /// The pending forward's output. While its graph is alive, a further forward does not settle
  /// the step as skipped: one backward of both outputs' sum covers both forwards. (A forward
  /// that raised records none, and the next forward settles its step.)
  void set_forward_output(const Tensor& output);
  bool backward_expected() const { return backward_expected_; }
  /// Marks parameter i ready without a hook (a rank that shadows a step).
  void mark_ready(int param);
  /// Ends the step: every bucket counts as complete and the ones not launched yet are
  /// launched in order, the held-back ones included.
  void launch_rest();

 private:
  GradReadiness(size_t params, Handlers handlers);
  void on_hook(int param, const std::weak_ptr<GradReadiness>& self);
  void launch_ready(size_t end);
  void finish(bool failed);

  Handlers handlers_;
  std::vector<HookHandle> hooks_;
  std::vector<std::vector<int>> buckets_;
  std::vector<int> bucket_of_;
  std::vector<int> pending_;
  int held_back_ = 0;
  std::vector<char> ready_;
  std::vector<int> trace_;
  int64_t ready_count_ = 0, ready_at_first_launch_ = -1;
  size_t next_launch_ = 0;
  bool paused_ = false, in_backward_ = false, backward_expected_ = false;
  bool warned_skipped_backward_ = false;
  std::weak_ptr<autograd::Node> pending_graph_;
};

/// Completes a traced ready order (parameter indices) with the parameters that never became
/// ready, latest registered first, then makes every rank of the group adopt the first rank's
/// order. Returns that order; `differs_anywhere` tells (on every rank) whether some rank's own
/// order was different. `counts`, if given, are per-rank 0/1 flags summed over the group in
/// the same round (how many ranks set each). Collective.
std::vector<int> agree_on_order(std::vector<int> trace, size_t parameters, const dist::Group& group,
                                bool& differs_anywhere, std::vector<int64_t>* counts = nullptr);

/// Raises unless both bucket caps are positive (0, negative and NaN are refused), tagged `op`.
void check_bucket_sizes(const char* op, double first_mb, double mb);

/// Cuts `order` into buckets of consecutive parameters with one dtype and device, the first
/// bucket up to first_mb, the others up to mb (a parameter larger than the cap gets its own).
std::vector<std::vector<int>> cut_buckets(const std::vector<int>& order,
                                          const std::vector<Tensor>& params, double first_mb,
                                          double mb);

}  // namespace weave::parallel::detail

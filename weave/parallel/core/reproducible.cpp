// Reproducible gradient reduction: binned sums folded per micro-batch, agreed windows, integer
// all_reduce.
#include "weave/parallel/core/reproducible.h"

#include <fmt/ranges.h>

#include <limits>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/kernels/kernels.h"
#include "weave/parallel/core/placement.h"

namespace weave::parallel::detail {

namespace {

constexpr const char* kThreadsKey = "weave.reproducible.threads";
constexpr const char* kRowsKey = "weave.reproducible.rows";

// This process's reproducible run (-1: not known), and the rows a checkpoint it resumed from
// was written with.
struct RunFacts {
  int64_t threads = -1, rows = -1, resumed_rows = -1;
};
RunFacts& run_facts() {
  static RunFacts facts;
  return facts;
}

}  // namespace

void record_reproducible_run(std::map<std::string, std::string>& user) {
  const RunFacts& facts = run_facts();
  if (facts.threads < 0) return;
  user[kThreadsKey] = std::to_string(facts.threads);
  const int64_t rows = facts.rows >= 0 ? facts.rows : facts.resumed_rows;
  if (rows >= 0) user[kRowsKey] = std::to_string(rows);
}

void check_reproducible_run(const std::map<std::string, std::string>& user, const char* op) {
  RunFacts& facts = run_facts();
  const auto threads = user.find(kThreadsKey), rows = user.find(kRowsKey);
  if (facts.threads < 0 || threads == user.end()) return;
  const int64_t saved = std::stoll(threads->second);
  WEAVE_CHECK(saved == facts.threads, op,
              "the checkpoint was written by a reproducible run with {} compute threads, and "
              "this one has {}: a kernel may add in another order with other threads, so the "
              "runs would part; hint: set_num_threads({}) here",
              saved, facts.threads, saved);
  if (rows == user.end()) return;
  facts.resumed_rows = std::stoll(rows->second);
  WEAVE_CHECK(facts.rows < 0 || facts.rows == facts.resumed_rows, op,
              "the checkpoint was written by a reproducible run with micro-batches of {} rows, "
              "and this one's have {}: the gradients would be computed at another shape; hint: "
              "keep the micro-batch size when the layout changes",
              facts.resumed_rows, facts.rows);
}

void check_reproducible(const std::vector<std::string>& names, const std::vector<Tensor>& params,
                        const dist::Group& group, const char* owner) {
  std::vector<std::string> spread;
  for (size_t i = 0; i < params.size(); ++i) {
    const Placement* placement = placement_of(params[i]);
    if (placement != nullptr &&
        (placement->spread() || (placement->context && placement->context->size() > 1)))
      spread.push_back(names[i] + " (" + placement->str() + ")");
  }
  const int64_t threads = kernels::max_threads();
  const std::vector<int64_t> words =
      dist::agree_max({spread.empty() ? 0 : 1, threads, -threads}, group);
  WEAVE_CHECK(spread.empty(), owner,
              "reproducible mode sums whole parameters, and {} of them are cut across ranks: {}; "
              "the collectives of tensor, context, expert, vocabulary and pipeline parallelism "
              "add in an order that changes with the layout, which this mode does not cover; "
              "hint: build the model whole on every rank (no tensor, context, expert or pipeline "
              "axis, shard_vocabulary = false), or leave reproducible off",
              spread.size(), fmt::join(spread, ", "));
  WEAVE_CHECK(words[0] == 0, owner,
              "another rank of group {} holds parameters cut across ranks, which reproducible "
              "mode does not cover; see its error",
              group.str());
  WEAVE_CHECK(words[1] == -words[2], owner,
              "reproducible mode needs the same compute thread count on every rank (a kernel "
              "adds in another order with other threads); this rank has {}, another {}; hint: "
              "set_num_threads(n) alike everywhere, and keep n when the layout changes",
              threads, words[1] == threads ? -words[2] : words[1]);
  run_facts().threads = threads;
}

BackwardEnds::BackwardEnds(const std::vector<Tensor>& params, std::function<void()> end)
    : end_(std::move(end)) {
  for (const Tensor& p : params)
    hooks_.push_back(p.register_post_accumulate_grad_hook([this](Tensor&) { on_hook(); }));
}

BackwardEnds::~BackwardEnds() {
  for (HookHandle& hook : hooks_) hook.remove();
}

void BackwardEnds::on_hook() {
  if (in_backward_) return;
  in_backward_ = true;
  autograd::queue_final_callback([this](bool failed) {
    in_backward_ = false;
    if (!failed) end_();
  });
}

ReproducibleGradients::ReproducibleGradients(std::vector<Tensor> params, std::string owner,
                                             int64_t pad_to, bool watch)
    : params_(std::move(params)), owner_(std::move(owner)) {
  int64_t total = 0;
  for (const Tensor& p : params_) {
    offsets_.push_back(total);
    total += p.numel();
  }
  total = (total + pad_to - 1) / pad_to * pad_to;
  const Device device = params_.empty() ? kCPU : params_.front().device();
  for (const Tensor& p : params_)
    WEAVE_CHECK(p.device() == device, owner_,
                "reproducible mode keeps its sums on one device; found parameters on {} and {}",
                device, p.device());
  window_ = zeros({total}, {.dtype = kUInt8, .device = device});
  limbs_ = zeros({2 * total}, {.dtype = kInt64, .device = device});
  for (const Tensor& p : params_) mark_reproducible(p);
  if (watch) ends_ = std::make_unique<BackwardEnds>(params_, [this] { end_microbatch(); });
}

void ReproducibleGradients::end_microbatch() {
  fold();
  ++microbatches_;
}

void ReproducibleGradients::fold() {
  NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor grad = params_[i].grad();
    if (!grad.defined() || grad.numel() == 0) continue;
    const int64_t n = grad.numel();
    kernels::binned_add(grad.contiguous(), window_.narrow(0, offsets_[i], n),
                        limbs_.narrow(0, 2 * offsets_[i], 2 * n));
    grad.zero_();
  }
}

void ReproducibleGradients::note_rows(const nn::Inputs& inputs) {
  const int64_t rows = inputs.x.defined() && inputs.x.dim() > 0 ? inputs.x.size(0) : 1;
  if (rows_ < 0) {
    RunFacts& facts = run_facts();
    WEAVE_CHECK(facts.resumed_rows < 0 || facts.resumed_rows == rows, owner_,
                "this run resumed from a checkpoint of a reproducible run whose micro-batches "
                "had {} rows, and its own have {}: the gradients would be computed at another "
                "shape, so the runs would part; hint: keep the micro-batch size when the layout "
                "changes",
                facts.resumed_rows, rows);
    rows_ = rows;
    if (facts.rows < 0) facts.rows = rows;
  }
  if (rows != rows_ && differing_rows_ < 0) differing_rows_ = rows;
}

ReproducibleGradients::Agreement ReproducibleGradients::agree(const dist::Group& group,
                                                              const std::vector<int64_t>& flags,
                                                              const dist::Group* outer) {
  // Words: rows and -rows (equal maxima: every rank's rows agree), then per rank its count and
  // flags in its own row (a maximum over zeros elsewhere is each rank's own value).
  const size_t per_rank = 1 + flags.size();
  std::vector<int64_t> words(3 + per_rank * size_t(group.size()), 0);
  words[0] = differing_rows_ >= 0 ? 1 : 0;
  words[1] = rows_;
  words[2] = rows_ < 0 ? std::numeric_limits<int64_t>::min() + 1 : -rows_;
  const size_t mine = 3 + per_rank * size_t(group.rank());
  words[mine] = microbatches_;
  for (size_t f = 0; f < flags.size(); ++f) words[mine + 1 + f] = flags[f];
  words = dist::agree_max(words, group);
  WEAVE_CHECK(differing_rows_ < 0, owner_,
              "reproducible mode takes micro-batches of one size, and this rank ran one of {} rows "
              "after one of {}; hint: split the global batch into micro-batches of a fixed size "
              "(parallel::MicroBatchPlan)",
              differing_rows_, rows_);
  WEAVE_CHECK(words[0] == 0, owner_,
              "another rank of group {} ran micro-batches of different sizes; see its error",
              group.str());
  const int64_t most = words[1], fewest = -words[2];  // over the ranks that ran any
  WEAVE_CHECK(most < 0 || most == fewest, owner_,
              "reproducible mode takes micro-batches of one size on every rank; this rank's have "
              "{} rows, another rank's {}; hint: split the global batch into micro-batches of "
              "a fixed size (parallel::MicroBatchPlan)",
              rows_, most == rows_ ? fewest : most);
  Agreement agreement;
  agreement.flagged.assign(flags.size(), 0);
  for (int r = 0; r < group.size(); ++r) {
    const size_t row = 3 + per_rank * size_t(r);
    agreement.microbatches += words[row];
    for (size_t f = 0; f < flags.size(); ++f) agreement.flagged[f] += words[row + 1 + f];
  }
  if (outer != nullptr) {  // each outer rank's total in its own word
    std::vector<int64_t> totals(size_t(outer->size()), 0);
    totals[size_t(outer->rank())] = agreement.microbatches;
    totals = dist::agree_max(totals, *outer);
    agreement.microbatches = 0;
    for (int64_t total : totals) agreement.microbatches += total;
  }
  return agreement;
}

// Every rank raises its sums to the group's highest window per element, so that the limbs add.
void ReproducibleGradients::align(const dist::Group& group) {
  Tensor windows = window_.clone();
  dist::all_reduce(windows, dist::ReduceOp::Max, group);
  kernels::binned_raise(window_, limbs_, windows);
}

void ReproducibleGradients::reduce_into(const std::vector<Tensor>& grads, const dist::Group& group,
                                        int64_t microbatches) {
  NoGradGuard no_grad;
  align(group);
  dist::all_reduce(limbs_, dist::ReduceOp::Sum, group);
  const double divisor = double(std::max<int64_t>(1, microbatches));
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t n = params_[i].numel();
    if (n == 0) continue;
    WEAVE_CHECK(grads[i].is_contiguous(), owner_,
                "internal: a gradient to write is not contiguous");
    kernels::binned_value(window_.narrow(0, offsets_[i], n),
                          limbs_.narrow(0, 2 * offsets_[i], 2 * n), divisor, grads[i]);
  }
  discard();
}

void ReproducibleGradients::reduce_scatter_into(const Tensor& shard, const dist::Group& group,
                                                int64_t microbatches, const dist::Group* replicas) {
  NoGradGuard no_grad;
  const int64_t piece = shard.numel();
  WEAVE_CHECK(piece * group.size() == window_.numel() && shard.is_contiguous(), owner_,
              "internal: a shard of {} elements over {} ranks does not cover {} sums", piece,
              group.size(), window_.numel());
  align(group);
  Tensor mine = empty({2 * piece}, {.dtype = kInt64, .device = limbs_.device()});
  dist::reduce_scatter(mine, limbs_, dist::ReduceOp::Sum, group);
  Tensor window = window_.narrow(0, group.rank() * piece, piece);
  if (replicas != nullptr) {  // the replicas' pieces are sums of the same shape: align, add
    Tensor highest = window.clone();
    dist::all_reduce(highest, dist::ReduceOp::Max, *replicas);
    kernels::binned_raise(window, mine, highest);
    dist::all_reduce(mine, dist::ReduceOp::Sum, *replicas);
  }
  kernels::binned_value(window, mine, double(std::max<int64_t>(1, microbatches)), shard);
  discard();
}

void ReproducibleGradients::discard() {
  window_.zero_();
  limbs_.zero_();
  microbatches_ = 0;
}

}  // namespace weave::parallel::detail

// DistributedDataParallel: model agreement, broadcast, gradient buckets traced in the first
// backward, per-bucket asynchronous averaging launched from post-accumulate hooks, and the
// end-of-backward wait.
#include "weave/parallel/ddp.h"

#include <algorithm>
#include <cstring>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/parallel/buckets.h"

namespace weave::parallel {

namespace {

dist::Group group_or_world(const std::optional<dist::Group>& group) {
  return group ? *group : dist::world();
}

// "name float32 [4, 3]" for every parameter, then every buffer.
std::vector<std::string> describe_model(const nn::Module& module) {
  std::vector<std::string> lines;
  for (const auto& [name, t] : module.named_parameters())
    lines.push_back(fmt::format("parameter {} {} {}", name, t.dtype(), t.shape()));
  for (const auto& [name, t] : module.named_buffers())
    lines.push_back(fmt::format("buffer {} {} {}", name, t.dtype(), t.shape()));
  return lines;
}

// Every rank's lines, gathered as one '\n'-joined byte string per rank.
std::vector<std::vector<std::string>> gather_lines(const std::vector<std::string>& lines,
                                                   const dist::Group& group) {
  std::string text;
  for (const std::string& line : lines) text += line + '\n';
  Tensor bytes = empty({int64_t(text.size())}, {.dtype = kUInt8});
  if (!text.empty()) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  Tensor lengths = empty({group.size()}, {.dtype = kInt64});
  dist::all_gather(lengths, full({1}, double(text.size()), {.dtype = kInt64}), group);
  Tensor all = dist::all_gather_uneven(bytes, group);
  std::vector<std::vector<std::string>> per_rank;
  const auto* data = static_cast<const char*>(all.data_ptr());
  int64_t offset = 0;
  for (int64_t length : lengths.to_vector<int64_t>()) {
    std::vector<std::string> rank_lines;
    std::string rank_text(data + offset, data + offset + length);
    offset += length;
    for (size_t start = 0; start < rank_text.size();) {
      size_t end = rank_text.find('\n', start);
      rank_lines.push_back(rank_text.substr(start, end - start));
      start = end + 1;
    }
    per_rank.push_back(std::move(rank_lines));
  }
  return per_rank;
}

}  // namespace

void check_same_model(const nn::Module& module, const std::optional<dist::Group>& group_option) {
  const dist::Group group = group_or_world(group_option);
  const auto all = gather_lines(describe_model(module), group);
  for (size_t r = 1; r < all.size(); ++r) {
    const auto& mine = all[0];
    const auto& theirs = all[r];
    for (size_t i = 0; i < std::max(mine.size(), theirs.size()); ++i) {
      const std::string a = i < mine.size() ? mine[i] : "nothing";
      const std::string b = i < theirs.size() ? theirs[i] : "nothing";
      WEAVE_CHECK(a == b, "DistributedDataParallel",
                  "ranks disagree on the model: entry {} is '{}' on rank {} but '{}' on rank {}; "
                  "hint: build the same model (same layers, shapes and dtypes) on every rank",
                  i, a, group.global_rank(0), b, group.global_rank(int(r)));
    }
  }
}

void synchronize(nn::Module& module, int root, const std::optional<dist::Group>& group_option) {
  const dist::Group group = group_or_world(group_option);
  NoGradGuard no_grad;
  for (const Tensor& t : module.parameters())
    if (t.defined()) dist::broadcast(t, root, group);
  for (const Tensor& t : module.buffers())
    if (t.defined()) dist::broadcast(t, root, group);
}

// ---- the reducer -------------------------------------------------------------------------

struct DistributedDataParallel::State {
  struct Bucket {
    std::vector<int> params;
    Tensor buffer;  // the gradients, flat, in the parameters' dtype
    Tensor wire;    // what travels: buffer itself, or its compressed copy
    int pending = 0;
    dist::Work work;
    bool launched = false;
  };

  DDPOptions options;
  dist::Group group;
  std::vector<std::string> names;
  std::vector<Tensor> params;
  std::vector<Tensor> views;  // params[i]'s gradient inside its bucket
  std::vector<int> bucket_of;
  std::vector<Bucket> buckets;
  std::vector<HookHandle> hooks;

  bool traced = false;
  std::vector<int> trace;  // first backward: parameter indices in the order they became ready
  bool no_sync = false;
  bool in_backward = false;
  std::vector<char> ready;
  int64_t ready_count = 0;
  size_t next_launch = 0;
  DDPStats stats;

  explicit State(DDPOptions o) : options(std::move(o)), group(group_or_world(options.group)) {}

  // A post-accumulate-grad hook fired for parameter i.
  void on_ready(int i, const std::weak_ptr<State>& self) {
    if (no_sync) return;
    if (!in_backward) {
      in_backward = true;
      std::fill(ready.begin(), ready.end(), 0);
      ready_count = 0;
      next_launch = 0;
      for (Bucket& b : buckets) {
        b.pending = int(b.params.size());
        b.launched = false;
      }
      stats.ready_before_first_launch = -1;
      autograd::queue_callback([self] {
        if (auto state = self.lock()) state->finish();
      });
    }
    if (ready[i]) return;
    ready[i] = 1;
    ++ready_count;
    if (!traced) {
      trace.push_back(i);
      return;
    }
    into_bucket(i);
    Bucket& b = buckets[bucket_of[i]];
    if (--b.pending == 0) launch_ready();
  }

  // Makes parameter i's gradient its bucket view (copying it in if it arrived elsewhere, as
  // after zero_grad(set_to_none = true)).
  void into_bucket(int i) {
    Tensor& view = views[i];
    Tensor grad = params[i].grad();
    if (grad.defined() && grad.storage() == view.storage() && grad.offset() == view.offset())
      return;
    if (grad.defined())
      view.copy_(grad);
    else
      view.zero_();
    params[i].set_grad(view);
  }

  // Launches, in bucket order, every bucket whose gradients are all in (order matters: every
  // rank must issue the same all_reduces in the same order).
  void launch_ready() {
    while (next_launch < buckets.size() && buckets[next_launch].pending == 0)
      launch(buckets[next_launch++]);
  }

  void launch(Bucket& b) {
    if (stats.ready_before_first_launch < 0) stats.ready_before_first_launch = ready_count;
    if (!b.wire.is_same(b.buffer)) b.wire.copy_(b.buffer);
    b.work = dist::all_reduce(b.wire, dist::ReduceOp::Avg, group, /*async_op=*/true);
    b.launched = true;
  }

  void build_buckets() {
    // Every rank must cut the same buckets, or their all_reduces would not pair up: all take
    // the first rank's order. Without find_unused_parameters every rank must have traced that
    // same order (the same model code on inputs of the same structure), and all raise if not.
    bool differs = false;
    const std::vector<int> order = detail::agree_on_order(trace, params.size(), group, differs);
    if (differs && !options.find_unused_parameters) {
      fail_if_unused();  // the likely cause, named where this rank has it
      WEAVE_FAIL("DistributedDataParallel",
                 "ranks produced gradients in different orders in the first backward, so their "
                 "buckets would differ; hint: every rank must run the same model code on inputs "
                 "of the same structure, or construct with {{.find_unused_parameters = true}}");
    }
    for (const auto& members :
         detail::cut_buckets(order, params, options.first_bucket_mb, options.bucket_mb)) {
      buckets.emplace_back();
      buckets.back().params = members;
    }
    views.assign(params.size(), Tensor());
    bucket_of.assign(params.size(), -1);
    for (size_t b = 0; b < buckets.size(); ++b) {
      Bucket& bucket = buckets[b];
      const Tensor& first = params[bucket.params.front()];
      int64_t total = 0;
      for (int i : bucket.params) total += params[i].numel();
      bucket.buffer = zeros({total}, {.dtype = first.dtype(), .device = first.device()});
      bucket.wire = options.compress && *options.compress != first.dtype()
                        ? empty({total}, {.dtype = *options.compress, .device = first.device()})
                        : bucket.buffer;
      int64_t offset = 0;
      for (int i : bucket.params) {
        views[i] =
            make_view(bucket.buffer, params[i].shape(), contiguous_strides(params[i].shape()),
                      bucket.buffer.offset() + offset);
        bucket_of[i] = int(b);
        offset += params[i].numel();
      }
    }
    stats.buckets = int(buckets.size());
    traced = true;
  }

  // End of a synchronizing backward: launch what is left (buckets holding parameters that got
  // no gradient), wait for every bucket, widen compressed results, report unused parameters.
  void finish() {
    in_backward = false;
    const bool first = !traced;
    if (first) build_buckets();
    // Parameters without a gradient from this backward keep what they accumulated (no_sync
    // micro-batches) or contribute zeros; then every bucket is complete.
    for (size_t i = 0; i < params.size(); ++i)
      if (first || !ready[i]) into_bucket(int(i));
    for (Bucket& b : buckets) b.pending = 0;
    launch_ready();
    stats.unused.clear();
    for (size_t i = 0; i < params.size(); ++i)
      if (!ready[i]) stats.unused.push_back(names[i]);
    stats.parameters = int64_t(params.size());
    for (Bucket& b : buckets) {
      b.work.wait();
      if (!b.wire.is_same(b.buffer)) b.buffer.copy_(b.wire);
    }
    // Unused parameters still get the group's average (their peers may have used them).
    for (size_t i = 0; i < params.size(); ++i)
      if (!ready[i]) params[i].set_grad(views[i]);
    if (!options.find_unused_parameters) fail_if_unused();
  }

  void fail_if_unused() const {
    std::vector<std::string> unused;
    for (size_t i = 0; i < params.size(); ++i)
      if (!ready[i]) unused.push_back(names[i]);
    WEAVE_CHECK(unused.empty(), "DistributedDataParallel",
                "parameters got no gradient in this backward: {}; hint: construct with "
                "{{.find_unused_parameters = true}} if the model leaves some unused",
                unused);
  }
};

DistributedDataParallel::DistributedDataParallel(nn::Module& module, DDPOptions options)
    : module_(module), state_(std::make_shared<State>(std::move(options))) {
  State& s = *state_;
  WEAVE_CHECK(s.options.first_bucket_mb > 0 && s.options.bucket_mb > 0, "DistributedDataParallel",
              "bucket sizes must be positive, found {} and {} MB", s.options.first_bucket_mb,
              s.options.bucket_mb);
  WEAVE_CHECK(!s.options.compress || *s.options.compress == kBFloat16 ||
                  *s.options.compress == kFloat16 || *s.options.compress == kFloat32,
              "DistributedDataParallel", "compress must be bfloat16, float16 or float32, found {}",
              *s.options.compress);
  WEAVE_CHECK(s.group.rank() >= 0, "DistributedDataParallel",
              "rank {} is not in group {}; hint: only its members construct the wrapper",
              dist::rank(), s.group.str());
  check_same_model(module, s.group);
  synchronize(module, s.options.broadcast_from, s.group);
  for (const auto& [name, p] : module.named_parameters()) {
    if (!p.defined() || !p.requires_grad()) continue;
    WEAVE_CHECK(is_floating(p.dtype()), "DistributedDataParallel",
                "parameter {} has dtype {}; gradients need a floating dtype", name, p.dtype());
    s.names.push_back(name);
    s.params.push_back(p);
  }
  s.ready.assign(s.params.size(), 0);
  s.hooks = detail::hook_ready(s.params, state_);
}

DistributedDataParallel::~DistributedDataParallel() {
  for (HookHandle& hook : state_->hooks) hook.remove();
}

Tensor DistributedDataParallel::forward(const Tensor& input) {
  State& s = *state_;
  // Gradients dropped by zero_grad(set_to_none = true) go back into their buckets, zeroed,
  // so backward accumulates in place instead of copying in afterwards.
  if (s.traced && !s.no_sync) {
    NoGradGuard no_grad;
    for (size_t i = 0; i < s.params.size(); ++i)
      if (!s.params[i].grad().defined()) {
        s.views[i].zero_();
        s.params[i].set_grad(s.views[i]);
      }
  }
  return module_.forward(input);
}

DistributedDataParallel::NoSyncGuard::NoSyncGuard(DistributedDataParallel& ddp)
    : ddp_(ddp), previous_(ddp.state_->no_sync) {
  ddp_.state_->no_sync = true;
}
DistributedDataParallel::NoSyncGuard::~NoSyncGuard() {
  ddp_.state_->no_sync = previous_;
}

const DDPStats& DistributedDataParallel::stats() const {
  return state_->stats;
}

std::vector<std::vector<std::string>> DistributedDataParallel::bucket_names() const {
  std::vector<std::vector<std::string>> out;
  for (const auto& bucket : state_->buckets) {
    out.emplace_back();
    for (int i : bucket.params) out.back().push_back(state_->names[i]);
  }
  return out;
}

}  // namespace weave::parallel

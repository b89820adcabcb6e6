// FullyShardedDataParallel: units of flat, padded, sharded parameters; gathers around each
// unit's forward and backward (prefetched), reduce-scatters launched as a unit's gradients are
// accumulated, and the step settled with the group at the end of backward.
#include "weave/parallel/fsdp.h"

#include <algorithm>
#include <map>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/parallel/agree.h"
#include "weave/parallel/ddp.h"
#include "weave/parallel/flat_buffer.h"
#include "weave/parallel/mesh.h"
#include "weave/parallel/placement.h"
#include "weave/parallel/tensor_parallel.h"
#include "weave/tensor/trace.h"

namespace weave::parallel {

namespace {
constexpr const char* kOp = "FullyShardedDataParallel";

// Module `name` ("blocks.0") under `root`, or null.
nn::Module* find_module(nn::Module& root, const std::string& name, const std::string& prefix = "") {
  for (const auto& [child_name, child] : root.named_children()) {
    const std::string full = nn::member_prefix(prefix, child_name);
    const std::string bare = full.empty() ? full : full.substr(0, full.size() - 1);
    if (bare == name) return child.get();
    if (name.rfind(full, 0) == 0 && !full.empty())
      if (nn::Module* found = find_module(*child, name, full)) return found;
  }
  return nullptr;
}

// Parameters that require grad (named_parameters lists a tied one once).
nn::NamedTensors trainable(const nn::Module& module) {
  nn::NamedTensors out;
  for (const auto& [name, p] : module.named_parameters())
    if (p.requires_grad()) out.emplace_back(name, p);
  return out;
}

// A module that holds another's shards as its parameters and its buffers as its own, for the
// checkpoint code.
class ShardModule : public nn::Module {
 public:
  ShardModule(const nn::NamedTensors& shards, const nn::NamedTensors& buffers) {
    for (const auto& [name, t] : shards) register_parameter(name, t);
    for (const auto& [name, t] : buffers) register_buffer(name, t);
  }
  Tensor forward(const Tensor&) override {
    WEAVE_FAIL(kOp, "the sharded module holds shards for checkpoints; it has no forward");
  }
};

}  // namespace

struct FullyShardedDataParallel::State {
  // One dtype's parameters of a unit, flat.
  struct Flat {
    std::vector<int> params;  // indices into State::params
    detail::FlatBuffer full;  // gathered parameters (the params' memory); released between uses
    Tensor shard;             // this rank's slice, a leaf of its own: what the optimizer steps
    uint64_t gathered_version = ~uint64_t{0};  // shard's version when `full` was last gathered
    dist::Work gather;
    bool gathering = false;
    // A gather that refills released memory with unchanged values keeps the storage's version,
    // so the tensors autograd saved from the parameters in forward stay valid for backward.
    bool refill = false;
    uint64_t version_before = 0;
    detail::FlatBuffer grads;  // whole gradients during backward (null between steps)
    Tensor reduced;  // this step's averaged shard gradient, added to shard.grad at the end
    dist::Work reduce;
    bool reducing = false;
  };
  struct Unit {
    std::string name;
    std::vector<nn::Module*> modules;
    std::vector<Flat> flats;
    int64_t forward_start_ns = 0;
    bool root = false;
  };

  FSDPOptions options;
  dist::Group group;
  std::vector<std::string> names;
  std::vector<Tensor> params;
  std::vector<int> unit_of;
  std::vector<Unit> units;  // the root unit last
  std::vector<int> forward_order;
  bool order_known = false;
  std::vector<HookHandle> module_hooks;
  std::shared_ptr<detail::GradReadiness> readiness;
  std::vector<int> reducing;         // units with reduce_scatters in flight, oldest first
  bool end_queued = false;           // this backward's end-of-backward work is queued
  std::vector<char> backward_began;  // this step's units whose backward began
  FSDPStats stats;
  std::unique_ptr<ShardModule> shard_module;

  explicit State(FSDPOptions o)
      : options(std::move(o)), group(detail::data_parallel_group(options.group, kOp)) {}

  bool full_shard() const { return options.sharding == ShardingStrategy::FullShard; }
  std::vector<Tensor> members(const Flat& f) const {
    std::vector<Tensor> out;
    for (int i : f.params) out.push_back(params[size_t(i)]);
    return out;
  }
  Unit& root() { return units.back(); }

  // ---- gathering ---------------------------------------------------------------------------

  bool needs_gather(const Flat& f) const {
    return f.full.flat.storage()->released() || f.gathered_version != f.shard.version();
  }

  void launch_gather(Unit& u, bool prefetch) {
    for (Flat& f : u.flats) {
      if (f.gathering || !needs_gather(f)) continue;
      f.refill = f.gathered_version == f.shard.version();
      f.version_before = f.full.flat.storage()->version();
      f.full.flat.storage()->allocate_again();
      f.gathered_version = f.shard.version();
      NoGradGuard no_grad;
      f.gather = dist::all_gather(f.full.flat, f.shard.detach(), group, /*async_op=*/true);
      f.gathering = true;
      ++stats.gathers;
      if (prefetch) ++stats.prefetches;
    }
  }

  void wait_gather(Unit& u) {
    for (Flat& f : u.flats)
      if (f.gathering) {
        f.gathering = false;
        f.gather.wait();
        if (f.refill) f.full.flat.storage()->restore_version(f.version_before);
      }
  }

  void ensure_gathered(Unit& u) {
    launch_gather(u, false);
    wait_gather(u);
  }

  void release(Unit& u) {
    if (!full_shard()) return;
    wait_gather(u);
    for (Flat& f : u.flats) f.full.flat.storage()->release();
  }

  // ---- forward -------------------------------------------------------------------------------

  int next_in_forward(int u, int direction) const {
    if (!order_known) return direction > 0 && u + 1 < int(units.size()) - 1 ? u + 1 : -1;
    auto it = std::find(forward_order.begin(), forward_order.end(), u);
    if (it == forward_order.end()) return -1;
    const auto pos = it - forward_order.begin() + direction;
    return pos >= 0 && pos < int64_t(forward_order.size()) ? forward_order[size_t(pos)] : -1;
  }

  void pre_forward(int u) {
    Unit& unit = units[size_t(u)];
    ensure_gathered(unit);
    if (recomputing()) return;
    if (!order_known &&
        std::find(forward_order.begin(), forward_order.end(), u) == forward_order.end())
      forward_order.push_back(u);
    if (options.prefetch) {
      const int next = next_in_forward(u, +1);
      if (next >= 0) launch_gather(units[size_t(next)], true);
    }
    if (trace::enabled()) unit.forward_start_ns = trace::detail::now_ns();
  }

  Tensor post_forward(int u, const Tensor& output) {
    Unit& unit = units[size_t(u)];
    if (recomputing()) return output;  // its backward follows at once: keep it gathered
    if (trace::enabled())
      trace::detail::record("fsdp", fmt::format("forward unit {}", u), unit.forward_start_ns,
                            trace::detail::now_ns(), fmt::format("\"unit\": {}", u));
    if (autograd::GradMode::is_enabled() && output.defined() && output.requires_grad()) {
      std::weak_ptr<State> weak = self;
      output.register_hook([weak, u](const Tensor&) -> Tensor {
        if (auto s = weak.lock()) s->pre_backward(u);
        return {};
      });
    }
    release(unit);
    return output;
  }

  // The checkpointed region of a unit runs again inside backward (autograd::checkpoint): its
  // hooks gather but neither prefetch in forward order nor release.
  static bool recomputing() { return autograd::detail::recomputing(); }

  // ---- backward ------------------------------------------------------------------------------

  void pre_backward(int u) {
    queue_end_of_backward();
    gather_for_backward(u);
    bind_grads(units[size_t(u)]);
  }

  // The collectives a unit's backward begins with: its gather, and the previous unit's prefetch.
  void gather_for_backward(int u) {
    backward_began[size_t(u)] = 1;
    ensure_gathered(units[size_t(u)]);
    if (options.prefetch) {
      const int previous = next_in_forward(u, -1);
      if (previous >= 0) launch_gather(units[size_t(previous)], true);
    }
  }

  // A rank whose backward stopped early issues what the others still issue, in their order: for
  // each unit whose backward had not begun (last forward first), its gathers, then its
  // gradients complete (zeros), which launches its reduce_scatter in the fixed order.
  void replay_rest_of_backward() {
    std::vector<int> order = forward_order;
    if (order.empty())
      for (int u = 0; u + 1 < int(units.size()); ++u) order.push_back(u);
    for (auto it = order.rbegin(); it != order.rend(); ++it) {
      if (!backward_began[size_t(*it)]) gather_for_backward(*it);
      for (const Flat& f : units[size_t(*it)].flats)
        for (int i : f.params) readiness->mark_ready(i);
    }
  }

  // Whole-gradient buffers for the unit, the parameters' .grad bound into them so backward
  // accumulates in place (what no_sync micro-batches accumulated is kept).
  void bind_grads(Unit& unit) {
    for (Flat& f : unit.flats) {
      if (!f.grads.flat.defined()) f.grads = detail::FlatBuffer::like(members(f), group.size());
      for (size_t k = 0; k < f.params.size(); ++k)
        detail::bind_grad(params[size_t(f.params[k])], f.grads.view(k));
    }
  }

  // Launched in the fixed unit order (GradReadiness): every rank issues the same collectives.
  void launch_reduce(int u) {
    Unit& unit = units[size_t(u)];
    bind_grads(unit);  // parameters without a gradient contribute zeros
    NoGradGuard no_grad;
    for (Flat& f : unit.flats) {
      f.reduced = empty(f.shard.shape(), {.dtype = f.shard.dtype(), .device = f.shard.device()});
      f.reduce = dist::reduce_scatter(f.reduced, f.grads.flat, dist::ReduceOp::Avg, group,
                                      /*async_op=*/true);
      f.reducing = true;
      ++stats.reduce_scatters;
    }
    // At most two units' whole gradients are alive: the one just launched, and the one before
    // while its reduce-scatter completes (it overlapped this unit's backward).
    for (int earlier : reducing) finish_reduce(units[size_t(earlier)]);
    reducing.assign(1, u);
    if (!unit.root) release(unit);
  }

  void finish_reduce(Unit& unit) {
    for (Flat& f : unit.flats) {
      if (!f.reducing) continue;
      f.reducing = false;
      f.reduce.wait();
      for (int i : f.params) params[size_t(i)].set_grad(Tensor());
      f.grads = {};
    }
  }

  void queue_end_of_backward() {
    if (end_queued) return;
    end_queued = true;
    std::weak_ptr<State> weak = self;
    autograd::queue_final_callback([weak](bool) {
      if (auto s = weak.lock()) s->end_of_backward();
    });
  }

  // Releases the parameters after a no_sync backward. A synchronizing one leaves that to
  // settle(), which may still need them gathered as they are (it replays a failed backward).
  void end_of_backward() {
    end_queued = false;
    if (readiness->backward_expected()) return;
    for (Unit& u : units) release(u);
  }

  // Ends a synchronizing step on this rank, in step with the group.
  void settle(bool failed) {
    const int64_t step = stats.steps++;
    if (failed) replay_rest_of_backward();
    readiness->launch_rest();
    Tensor flag = full({1}, failed ? 1.0 : 0.0, {.dtype = kInt64});
    dist::all_reduce(flag, dist::ReduceOp::Sum, group);
    const int64_t failed_ranks = flag.item<int64_t>();
    for (int u : reducing) finish_reduce(units[size_t(u)]);
    reducing.clear();
    NoGradGuard no_grad;
    if (failed_ranks == 0)
      for (Unit& u : units)
        for (Flat& f : u.flats) {
          if (f.shard.grad().defined())
            f.shard.grad().add_(f.reduced);
          else
            f.shard.set_grad(f.reduced);
        }
    for (Unit& u : units) {
      for (Flat& f : u.flats) f.reduced = Tensor();
      release(u);
    }
    if (failed_ranks > 0) ++stats.failed_steps;
    if (failed_ranks == 0 || failed) return;  // a failed rank's own error is the one to report
    WEAVE_FAIL(kOp,
               "{} of the {} ranks of group {} failed in backward in step {} (see their error), so "
               "every rank discarded this step's gradients; hint: catch this error and go on to "
               "the next batch on every rank, as the failing rank does",
               failed_ranks, group.size(), group.str(), step);
  }

  std::weak_ptr<State> self;
};

namespace {

// Each unit: a name and its modules.
std::vector<std::pair<std::string, std::vector<nn::Module*>>> resolve_units(
    nn::Module& module, const FSDPOptions& options) {
  std::vector<std::pair<std::string, std::vector<nn::Module*>>> out;
  if (!options.units.empty()) {
    for (const std::string& name : options.units) {
      nn::Module* found = find_module(module, name);
      WEAVE_CHECK(found != nullptr, kOp,
                  "unit '{}' names no submodule; expected one of the module's children by "
                  "their parameter prefix (for example '{}'); hint: list the names with "
                  "named_children()",
                  name, module.named_children().empty() ? "" : module.named_children()[0].first);
      out.push_back({name, {found}});
    }
    for (size_t a = 0; a < out.size(); ++a)
      for (size_t b = 0; b < out.size(); ++b)
        WEAVE_CHECK(a == b || out[b].first.rfind(out[a].first + ".", 0) != 0, kOp,
                    "unit '{}' lies inside unit '{}'; units must not nest", out[b].first,
                    out[a].first);
    return out;
  }
  double bytes = 0;
  for (const auto& [name, child] : module.named_children()) {
    double child_bytes = 0;
    for (const auto& [n, p] : trainable(*child)) child_bytes += double(p.numel() * p.itemsize());
    if (child_bytes == 0 && (out.empty() || options.unit_mb == 0)) continue;
    if (out.empty() || options.unit_mb == 0 || bytes >= options.unit_mb * 1024 * 1024) {
      out.push_back({name, {}});
      bytes = 0;
    }
    out.back().second.push_back(child.get());
    bytes += child_bytes;
  }
  return out;
}

}  // namespace

FullyShardedDataParallel::FullyShardedDataParallel(nn::Module& module, FSDPOptions options)
    : module_(module), state_(std::make_shared<State>(std::move(options))) {
  State& s = *state_;
  s.self = state_;
  WEAVE_CHECK(s.group.rank() >= 0, kOp,
              "rank {} is not in group {}; hint: only its members construct the wrapper",
              dist::rank(), s.group.str());
  check_same_model(module, s.group);
  std::vector<std::pair<std::string, std::vector<nn::Module*>>> unit_specs;
  detail::check_together([&] { unit_specs = resolve_units(module, s.options); }, s.group, kOp);
  broadcast_parameters(module, s.options.broadcast_from, s.group);

  for (const auto& [name, p] : trainable(module)) {
    WEAVE_CHECK(is_floating(p.dtype()), kOp,
                "parameter {} has dtype {}; gradients need a floating dtype", name, p.dtype());
    s.names.push_back(name);
    s.params.push_back(p);
  }
  std::map<const void*, int> index;
  for (size_t i = 0; i < s.params.size(); ++i) index[s.params[i].impl()] = int(i);
  // A parameter belongs to the one unit that uses it; one in several units, or in none, to root.
  std::vector<int> owners(s.params.size(), -1);
  for (size_t u = 0; u < unit_specs.size(); ++u)
    for (nn::Module* m : unit_specs[u].second)
      for (const auto& [n, p] : trainable(*m)) {
        int& owner = owners[size_t(index.at(p.impl()))];
        owner = owner == -1 || owner == int(u) ? int(u) : -2;
      }
  const int64_t n = s.group.size();
  const std::map<std::string, TensorSplit> splits = tensor_splits(module);
  auto build_unit = [&](const std::string& name, std::vector<nn::Module*> modules,
                        std::vector<int> members, bool root) {
    State::Unit unit;
    unit.name = name;
    unit.modules = std::move(modules);
    unit.root = root;
    std::vector<std::pair<DType, Device>> kinds;
    for (int i : members) {
      const auto kind = std::make_pair(s.params[size_t(i)].dtype(), s.params[size_t(i)].device());
      if (std::find(kinds.begin(), kinds.end(), kind) == kinds.end()) kinds.push_back(kind);
    }
    for (const auto& [dtype, device] : kinds) {
      State::Flat f;
      for (int i : members)
        if (s.params[size_t(i)].dtype() == dtype && s.params[size_t(i)].device() == device)
          f.params.push_back(i);
      f.full = detail::FlatBuffer::adopt(s.members(f), n);
      const int64_t per_rank = f.full.flat.numel() / n;
      NoGradGuard no_grad;
      f.shard = f.full.flat.narrow(0, s.group.rank() * per_rank, per_rank).clone().detach();
      f.shard.requires_grad_(true);
      f.gathered_version = f.shard.version();
      // Sharded checkpoints describe the shard by the parameters it covers.
      detail::FlatShard layout{.members = {},
                               .names = {},
                               .splits = {},
                               .offsets = f.full.offsets,
                               .shapes = f.full.shapes,
                               .begin = s.group.rank() * per_rank};
      for (int i : f.params) {
        layout.members.push_back(s.params[size_t(i)].impl());
        layout.names.push_back(s.names[size_t(i)]);
        auto split = splits.find(s.names[size_t(i)]);
        layout.splits.push_back(split == splits.end() ? TensorSplit{} : split->second);
      }
      detail::register_flat_shard(f.shard, std::move(layout));
      unit.flats.push_back(std::move(f));
    }
    s.units.push_back(std::move(unit));
  };
  for (size_t u = 0; u < unit_specs.size(); ++u) {
    std::vector<int> members;
    for (size_t i = 0; i < s.params.size(); ++i)
      if (owners[i] == int(u)) members.push_back(int(i));
    if (!members.empty()) build_unit(unit_specs[u].first, unit_specs[u].second, members, false);
  }
  std::vector<int> root_members;
  for (size_t i = 0; i < s.params.size(); ++i)
    if (owners[i] < 0) root_members.push_back(int(i));
  build_unit("", {}, root_members, true);  // possibly empty: keeps "the root is last" simple
  s.unit_of.assign(s.params.size(), -1);
  for (size_t u = 0; u < s.units.size(); ++u)
    for (const State::Flat& f : s.units[u].flats)
      for (int i : f.params) s.unit_of[size_t(i)] = int(u);

  // Hooks: a unit gathers before its first module's forward and reshards after its last's.
  for (size_t u = 0; u + 1 < s.units.size(); ++u) {
    std::weak_ptr<State> weak = state_;
    const int unit = int(u);
    nn::Module* last = s.units[u].modules.back();
    for (nn::Module* m : s.units[u].modules)
      s.module_hooks.push_back(
          m->register_forward_pre_hook([weak, unit](nn::Module&, const Tensor&) {
            if (auto alive = weak.lock()) alive->pre_forward(unit);
            return Tensor();
          }));
    s.module_hooks.push_back(
        last->register_forward_hook([weak, unit](nn::Module&, const Tensor&, const Tensor& out) {
          if (auto alive = weak.lock()) return alive->post_forward(unit, out);
          return Tensor();
        }));
  }
  // Reduce-scatters go out in reverse unit order (backward's usual order), the root last.
  std::vector<std::vector<int>> buckets;
  for (int u = int(s.units.size()) - 2; u >= 0; --u) {
    buckets.emplace_back();
    for (const State::Flat& f : s.units[size_t(u)].flats)
      buckets.back().insert(buckets.back().end(), f.params.begin(), f.params.end());
  }
  buckets.emplace_back();
  for (const State::Flat& f : s.root().flats)
    buckets.back().insert(buckets.back().end(), f.params.begin(), f.params.end());
  const int unit_count = int(s.units.size());
  State* raw = &s;
  s.readiness = detail::GradReadiness::create(
      s.params,
      {.ready = [raw](int i) { raw->bind_grads(raw->units[size_t(raw->unit_of[size_t(i)])]); },
       .launch = [raw, unit_count](
                     int b) { raw->launch_reduce(b + 1 == unit_count ? b : unit_count - 2 - b); },
       .finish = [raw](bool failed) { raw->settle(failed); }});
  std::erase_if(buckets, [](const std::vector<int>& b) { return b.empty(); });
  s.readiness->set_buckets(buckets);
  for (State::Unit& u : s.units) s.release(u);
  s.backward_began.assign(s.units.size(), 0);
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  for (HookHandle& hook : state_->module_hooks) hook.remove();
  for (const State::Unit& u : state_->units)
    for (const State::Flat& f : u.flats) detail::forget_flat_shard(f.shard);
}

Tensor FullyShardedDataParallel::forward(const Tensor& input) {
  State& s = *state_;
  const bool synchronizing = s.readiness->begin_forward(kOp, s.stats.steps);
  s.ensure_gathered(s.root());
  if (autograd::GradMode::is_enabled()) s.backward_began.assign(s.units.size(), 0);
  if (synchronizing) s.bind_grads(s.root());
  Tensor out = module_(input);
  if (!s.order_known && !s.forward_order.empty()) s.order_known = true;
  if (!autograd::GradMode::is_enabled() || !out.requires_grad()) {
    for (State::Unit& u : s.units) s.release(u);  // no backward follows
  } else {
    if (synchronizing) s.readiness->expect_backward();
    std::weak_ptr<State> weak = state_;
    out.register_hook([weak](const Tensor&) -> Tensor {
      if (auto alive = weak.lock()) alive->queue_end_of_backward();
      return {};
    });
  }
  return out;
}

std::vector<Tensor> FullyShardedDataParallel::parameters() const {
  std::vector<Tensor> out;
  for (const State::Unit& u : state_->units)
    for (const State::Flat& f : u.flats) out.push_back(f.shard);
  return out;
}

std::vector<std::string> FullyShardedDataParallel::shard_names() const {
  std::vector<std::string> out;
  for (size_t u = 0; u < state_->units.size(); ++u)
    for (const State::Flat& f : state_->units[u].flats)
      out.push_back(fmt::format("unit{}_{}", u, dtype_name(f.shard.dtype())));
  return out;
}

std::vector<std::string> FullyShardedDataParallel::unit_names() const {
  std::vector<std::string> out;
  for (const State::Unit& u : state_->units)
    if (!u.flats.empty()) out.push_back(u.name);
  return out;
}

NoSyncGuard FullyShardedDataParallel::no_sync() {
  return NoSyncGuard(state_->readiness);
}

nn::NamedTensors FullyShardedDataParallel::full_state_dict() {
  State& s = *state_;
  NoGradGuard no_grad;
  std::map<const void*, Tensor> values;
  for (State::Unit& u : s.units)
    for (State::Flat& f : u.flats) {
      Tensor whole =
          empty(f.full.flat.shape(), {.dtype = f.shard.dtype(), .device = f.shard.device()});
      dist::all_gather(whole, f.shard.detach(), s.group);
      for (size_t k = 0; k < f.params.size(); ++k)
        values[s.params[size_t(f.params[k])].impl()] = f.full.view_in(whole, k).clone();
    }
  nn::NamedTensors out;
  for (const auto& [name, p] : module_.named_parameters()) {
    auto it = values.find(p.impl());
    out.emplace_back(name, it != values.end() ? it->second : p.detach().clone());
  }
  for (const auto& [name, b] : module_.named_buffers()) out.emplace_back(name, b.detach().clone());
  return out;
}

void FullyShardedDataParallel::load_full_state_dict(const nn::NamedTensors& state) {
  State& s = *state_;
  detail::check_together([&] { module_.check_state_dict(state, /*strict=*/true); }, s.group, kOp);
  std::map<std::string, Tensor> by_name(state.begin(), state.end());
  NoGradGuard no_grad;
  for (State::Unit& u : s.units)
    for (State::Flat& f : u.flats) {
      Tensor whole =
          zeros(f.full.flat.shape(), {.dtype = f.shard.dtype(), .device = f.shard.device()});
      for (size_t k = 0; k < f.params.size(); ++k)
        f.full.view_in(whole, k).copy_(by_name.at(s.names[size_t(f.params[k])]));
      f.shard.detach().copy_(whole.narrow(0, s.group.rank() * f.shard.numel(), f.shard.numel()));
    }
  for (auto& [name, b] : module_.named_buffers()) {
    Tensor target = b;
    target.copy_(by_name.at(name));
  }
}

nn::Module& FullyShardedDataParallel::sharded_module() {
  if (!state_->shard_module) {
    const std::vector<std::string> names = shard_names();
    const std::vector<Tensor> shards = parameters();
    nn::NamedTensors named;
    for (size_t k = 0; k < shards.size(); ++k) named.emplace_back(names[k], shards[k]);
    state_->shard_module = std::make_unique<ShardModule>(named, module_.named_buffers());
  }
  return *state_->shard_module;
}

const FSDPStats& FullyShardedDataParallel::stats() const {
  return state_->stats;
}

const dist::Group& FullyShardedDataParallel::group() const {
  return state_->group;
}

}  // namespace weave::parallel

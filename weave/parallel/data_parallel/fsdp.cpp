// FullyShardedDataParallel: units of flat, padded, sharded parameters; gathers around each
// unit's forward and backward (prefetched), reduce-scatters launched as a unit's gradients are
// accumulated, and the step settled with the group at the end of backward.
#include "weave/parallel/data_parallel/fsdp.h"
#include "weave/parallel/data_parallel/fsdp_state.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/nn/deferred.h"
#include "weave/parallel/core/agree.h"
#include "weave/parallel/core/flat_buffer.h"
#include "weave/parallel/core/mesh.h"
#include "weave/parallel/core/placement.h"
#include "weave/parallel/core/readiness.h"
#include "weave/parallel/core/replicas.h"
#include "weave/tensor/tensor_impl.h"
#include "weave/tensor/trace.h"

namespace weave::parallel {

namespace {

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

// The parameters it shards (named_parameters lists a tied one once): those that train and the
// frozen ones, which are gathered but never reduced.
nn::NamedTensors sharded(const nn::Module& module) {
  nn::NamedTensors out;
  for (const auto& [name, p] : module.named_parameters())
    if (p.defined()) out.emplace_back(name, p);
  return out;
}

}  // namespace

namespace {

using UnitSpecs = std::vector<std::pair<std::string, std::vector<nn::Module*>>>;
using State = FullyShardedDataParallel::State;

// Each unit: a name and its modules.
UnitSpecs resolve_units(nn::Module& module, const FSDPOptions& options) {
  std::vector<std::pair<std::string, std::vector<nn::Module*>>> out;
  // Units named in the options, else the model's own (a library model's blocks), else children.
  const std::vector<std::string> named =
      !options.units.empty() || options.unit_mb > 0 ? options.units : module.shard_units();
  if (!named.empty()) {
    for (const std::string& name : named) {
      nn::Module* found = find_module(module, name);
      WEAVE_CHECK(found != nullptr, kFSDPOp,
                  "unit '{}' names no submodule; expected one of the module's children by "
                  "their parameter prefix (for example '{}'); hint: list the names with "
                  "named_children()",
                  name, module.named_children().empty() ? "" : module.named_children()[0].first);
      out.push_back({name, {found}});
    }
    for (size_t a = 0; a < out.size(); ++a)
      for (size_t b = 0; b < out.size(); ++b)
        WEAVE_CHECK(a == b || out[b].first.rfind(out[a].first + ".", 0) != 0, kFSDPOp,
                    "unit '{}' lies inside unit '{}'; units must not nest", out[b].first,
                    out[a].first);
    return out;
  }
  double bytes = 0;
  for (const auto& [name, child] : module.named_children()) {
    double child_bytes = 0;
    for (const auto& [n, p] : sharded(*child)) child_bytes += double(p.numel() * p.itemsize());
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

// The options that shape the collectives, then each unit and its parameters: what every rank
// must hold alike (units of equal sizes in another order would pair the wrong shards).
std::vector<std::string> describe_units(
    const FSDPOptions& options,
    const std::vector<std::pair<std::string, std::vector<nn::Module*>>>& unit_specs,
    const dist::Group& group) {
  std::vector<std::string> lines = {
      fmt::format("sharding {}",
                  options.sharding == ShardingStrategy::FullShard ? "FullShard" : "ShardGradOp"),
      fmt::format("unit_mb {}", options.unit_mb),
      fmt::format("reshard_after_forward {}", options.reshard_after_forward),
      fmt::format("prefetch {}", options.prefetch),
      fmt::format("broadcast_from {}", options.broadcast_from),
      fmt::format("check_finite {}", options.check_finite),
      fmt::format("replicate_group size {}",
                  options.replicate_group ? options.replicate_group->size() : 0),
      fmt::format("param_dtype {}", options.param_dtype ? dtype_name(*options.param_dtype) : "-"),
      fmt::format("reduce_dtype {}",
                  options.reduce_dtype ? dtype_name(*options.reduce_dtype) : "-")};
  for (const auto& [name, modules] : unit_specs) {
    std::string line = fmt::format("unit '{}':", name);
    for (const nn::Module* m : modules)
      for (const auto& [n, p] : sharded(*m))  // spread experts' names differ by rank
        line += fmt::format(" {} {}{}", detail::spread_expert_in(p, group) ? "(expert)" : n,
                            p.shape(), p.requires_grad() ? "" : " frozen");
    lines.push_back(std::move(line));
  }
  return lines;
}

// HSDP's groups: this rank in both, and in no other rank's both (each replica of a shard sits
// in another shard group).
void check_hybrid(const dist::Group& shard, const dist::Group& replicate) {
  WEAVE_CHECK(replicate.rank() >= 0, kFSDPOp,
              "rank {} is not in its replicate_group {}; hint: the ranks holding the same "
              "shards, one from each shard group",
              dist::rank(), replicate.str());
  for (int r : replicate.ranks())
    WEAVE_CHECK(r == dist::rank() || !shard.contains(r), kFSDPOp,
                "rank {} is in both the shard group {} and the replicate_group {}; hint: a "
                "replica of this rank's shard lives in another shard group",
                r, shard.str(), replicate.str());
}

// HSDP's groups must be a replicate x shard grid of the data ranks. Over `mine` (a shard group,
// then a replicate group) each member's `other` group has one size, holds the member at one
// place, and shares no rank with another member's: a replicate group across the shard groups'
// places (replicas {0, 3} over shards {0, 1}, {2, 3}) would average different shards.
std::string grid_disagreement(const dist::Group& mine, const dist::Group& other,
                              const char* mine_name, const char* other_name) {
  const std::vector<std::string> all = detail::all_gather_bytes(
      fmt::format("{} {}", other.rank(), fmt::join(other.ranks(), ",")), mine);
  std::vector<int> place;
  std::vector<std::vector<int>> members;
  for (const std::string& text : all) {
    place.push_back(std::stoi(text.substr(0, text.find(' '))));
    std::vector<int>& ranks = members.emplace_back();
    for (size_t at = text.find(' ') + 1; at < text.size(); at = text.find(',', at) + 1) {
      ranks.push_back(std::stoi(text.substr(at)));
      if (text.find(',', at) == std::string::npos) break;
    }
  }
  const char* hint =
      "hint: the shard and replicate groups are a replicate x shard grid of the data ranks, "
      "a replica at the same place in every shard group: ProcessMesh({.data = n, .replicate = "
      "r}) gives them as mesh.shard() and mesh.replicate()";
  auto str = [](const std::vector<int>& ranks) {
    return fmt::format("[{}]", fmt::join(ranks, ", "));
  };
  for (size_t a = 0; a < all.size(); ++a)
    for (size_t b = a + 1; b < all.size(); ++b) {
      const int ra = mine.global_rank(int(a)), rb = mine.global_rank(int(b));
      if (place[a] != place[b] || members[a].size() != members[b].size())
        return fmt::format(
            "the {} {} holds rank {} at place {} of its {} {} and rank {} at place "
            "{} of its {} {}; {}",
            mine_name, mine.str(), ra, place[a], other_name, str(members[a]), rb, place[b],
            other_name, str(members[b]), hint);
      for (int r : members[a])
        if (std::find(members[b].begin(), members[b].end(), r) != members[b].end())
          return fmt::format(
              "in the {} {}, the {}s of ranks {} and {} ({} and {}) share rank {}; {}", mine_name,
              mine.str(), other_name, ra, rb, str(members[a]), str(members[b]), r, hint);
    }
  return {};
}

// The wrapper's arguments, checked on this rank alone.
void check_arguments(const State& s) {
  WEAVE_CHECK(std::isfinite(s.options.unit_mb) && s.options.unit_mb >= 0, kFSDPOp,
              "unit_mb must be a finite size in MB, 0 or more, found {}", s.options.unit_mb);
  WEAVE_CHECK(s.options.broadcast_from >= 0 && s.options.broadcast_from < s.group.size(), kFSDPOp,
              "broadcast_from must be a rank of group {} (0 to {}), found {}", s.group.str(),
              s.group.size() - 1, s.options.broadcast_from);
  for (const std::optional<DType>& dtype :
       {s.options.param_dtype, s.options.reduce_dtype, s.options.output_dtype})
    WEAVE_CHECK(!dtype || is_floating(*dtype), kFSDPOp,
                "param_dtype, reduce_dtype and output_dtype are floating dtypes (bfloat16, "
                "float16, float32, float64), found {}",
                *dtype);
  if (const auto& replicate = s.options.replicate_group) check_hybrid(s.group, *replicate);
}

// Every rank that builds the model agrees on it before anything is sharded: the tensor-parallel
// and expert groups on its seed, the shard group and (HSDP) the replicate group on the model,
// its deferred seed, the options and the units, and on the groups' grid. Each check notes its
// error in one verdict, shared over shard, replicate and shard group again, so every rank raises
// together and none waits for a peer that already left.
UnitSpecs agree_on_units(nn::Module& module, State& s) {
  WEAVE_CHECK(s.group.rank() >= 0, kFSDPOp,
              "rank {} is not in group {}; hint: only its members construct the wrapper",
              dist::rank(), s.group.str());
  const std::optional<dist::Group>& replicate = s.options.replicate_group;
  detail::Verdict verdict(kFSDPOp);
  detail::agree_on_seeds_over_cuts(module, verdict);
  UnitSpecs unit_specs;
  verdict.check([&] {
    check_arguments(s);
    unit_specs = resolve_units(module, s.options);
  });
  auto compare_over = [&](const dist::Group& group) {
    verdict.note(detail::lines_disagreement(
        detail::model_lines(module, group, /*with_seeds=*/true), group, "the model",
        "build the same model (same layers, shapes and dtypes; a deferred one under the same "
        "nn::DeferredInit seed) on every rank"));
    verdict.note(detail::lines_disagreement(
        describe_units(s.options, unit_specs, group), group, "the options and units",
        "construct FullyShardedDataParallel with the same FSDPOptions (units in the same "
        "order) on every rank, replicas included"));
  };
  compare_over(s.group);
  if (replicate)
    verdict.note(grid_disagreement(s.group, *replicate, "shard group", "replicate group"));
  verdict.share(s.group);
  if (replicate) {
    if (replicate->rank() >= 0) {  // else this rank's own error is out already
      compare_over(*replicate);
      verdict.note(grid_disagreement(*replicate, s.group, "replicate group", "shard group"));
      verdict.share(*replicate);
    }
    verdict.share(s.group);
  }
  verdict.raise_if_failed();
  return unit_specs;
}

// The replicas start equal: broadcast from broadcast_from over the shard group (and, HSDP, from
// the first replica), or drawn alike by a deferred model's agreed seed.
void start_replicas_equal(nn::Module& module, State& s) {
  for (const auto& [name, p] : sharded(module)) {
    s.names.push_back(name);
    s.params.push_back(p);
  }
  s.replicas = detail::replica_groups(s.names, s.params, s.group, kFSDPOp);
  detail::broadcast_replicas(module, s.params, s.replicas, s.options.broadcast_from);
  if (const auto& replicate = s.options.replicate_group) {
    detail::check_together(
        [&] {
          WEAVE_CHECK(
              std::count(s.replicas.vocabulary.begin(), s.replicas.vocabulary.end(), false) == 1,
              kFSDPOp,
              "experts spread over ranks are sharded apart, which a replicate group "
              "does not follow; hint: HSDP without expert parallelism, or plain FSDP");
        },
        *replicate, kFSDPOp);
    std::vector<Tensor> dense = module.buffers();
    for (const Tensor& p : module.parameters())
      if (!nn::is_deferred(p)) dense.push_back(p);
    detail::broadcast_packed(dense, 0, *replicate);
  }
}

// The units, each over the parameters it owns: a parameter belongs to the one unit that uses
// it; one in several units, or in none, to the root unit (last, possibly empty).
void build_units(nn::Module& module, State& s, const UnitSpecs& unit_specs) {
  for (size_t i = 0; i < s.params.size(); ++i)
    WEAVE_CHECK(is_floating(s.params[i].dtype()), kFSDPOp,
                "parameter {} has dtype {}; gradients need a floating dtype", s.names[i],
                s.params[i].dtype());
  std::map<const void*, int> index;
  for (size_t i = 0; i < s.params.size(); ++i) index[s.params[i].impl()] = int(i);
  std::vector<int> owners(s.params.size(), -1);
  for (size_t u = 0; u < unit_specs.size(); ++u)
    for (nn::Module* m : unit_specs[u].second)
      for (const auto& [n, p] : sharded(*m)) {
        int& owner = owners[size_t(index.at(p.impl()))];
        owner = owner == -1 || owner == int(u) ? int(u) : -2;
      }
  const std::map<std::string, TensorSplit> splits = tensor_splits(module);
  auto owned_by = [&](auto&& owns) {
    std::vector<int> members;
    for (size_t i = 0; i < s.params.size(); ++i)
      if (owns(owners[i])) members.push_back(int(i));
    return members;
  };
  for (size_t u = 0; u < unit_specs.size(); ++u) {
    const std::vector<int> members = owned_by([u](int owner) { return owner == int(u); });
    if (!members.empty())
      s.units.emplace_back(unit_specs[u].first, unit_specs[u].second, /*root=*/false, members,
                           s.params, s.names, splits, s.replicas, s.options);
  }
  s.units.emplace_back("", std::vector<nn::Module*>{}, /*root=*/true,
                       owned_by([](int owner) { return owner < 0; }), s.params, s.names, splits,
                       s.replicas, s.options);
  s.unit_of.assign(s.params.size(), -1);
  for (size_t u = 0; u < s.units.size(); ++u)
    for (const State::Flat& f : s.units[u].flats())
      for (int i : f.params) s.unit_of[size_t(i)] = int(u);
}

// FSDPOptions::reproducible: each flat's binned sums, laid out (and padded) as the flat, their
// hooks installed before the readiness hooks, so that a backward's end folds before it settles.
void install_reproducible(State& s) {
  WEAVE_CHECK(!s.options.offload_to_cpu, kFSDPOp,
              "reproducible mode keeps its sums beside the gradients; offload_to_cpu moves the "
              "shards away; hint: one or the other");
  detail::check_reproducible(s.names, s.params, s.group, kFSDPOp);
  std::vector<std::shared_ptr<detail::ReproducibleGradients>> all;
  for (State::Unit& u : s.units)
    for (State::Flat& f : u.flats()) {
      if (f.frozen) continue;
      f.sums = std::make_shared<detail::ReproducibleGradients>(
          State::Unit::members(f, s.params), kFSDPOp, f.group.size(), /*watch=*/false);
      mark_reproducible(f.shard);
      all.push_back(f.sums);
    }
  // One end per backward for every flat: each counts the same micro-batches.
  s.microbatch_ends = std::make_unique<detail::BackwardEnds>(s.params, [all] {
    for (const auto& sums : all) sums->end_microbatch();
  });
}

// A unit gathers before its first module's forward and reshards after its last's.
void install_module_hooks(const std::shared_ptr<State>& state) {
  State& s = *state;
  for (size_t u = 0; u + 1 < s.units.size(); ++u) {
    std::weak_ptr<State> weak = state;
    const int unit = int(u);
    nn::Module* last = s.units[u].modules().back();
    for (nn::Module* m : s.units[u].modules())
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
}

// Reduce-scatters go out in reverse unit order (backward's usual order), the root last: one
// bucket per unit with parameters, built with the unit it launches.
void install_readiness(const std::shared_ptr<State>& state) {
  State& s = *state;
  std::vector<int> reduce_order;
  for (int u = int(s.units.size()) - 2; u >= 0; --u) reduce_order.push_back(u);
  reduce_order.push_back(int(s.units.size()) - 1);
  std::vector<std::vector<int>> buckets;
  std::vector<int> unit_of_bucket;
  for (int u : reduce_order) {
    std::vector<int> members;
    for (const State::Flat& f : s.units[size_t(u)].flats())
      if (!f.frozen) members.insert(members.end(), f.params.begin(), f.params.end());
    if (members.empty()) continue;  // an empty root unit has nothing to reduce
    buckets.push_back(std::move(members));
    unit_of_bucket.push_back(u);
  }
  // The same capture as every other hook: the wrapper may be gone when a callback runs.
  std::weak_ptr<State> weak = state;
  s.readiness = detail::GradReadiness::create(
      s.params, {.ready =
                     [weak](int i) {
                       if (auto alive = weak.lock())
                         alive->bind_grads(alive->units[size_t(alive->unit_of[size_t(i)])]);
                     },
                 .launch =
                     [weak, unit_of_bucket](int b) {
                       if (auto alive = weak.lock())
                         alive->launch_reduce(unit_of_bucket[size_t(b)]);
                     },
                 .finish =
                     [weak](bool failed) {
                       if (auto alive = weak.lock()) alive->settle(failed);
                     }});
  s.readiness->set_buckets(buckets);
}

}  // namespace

FullyShardedDataParallel::FullyShardedDataParallel(nn::Module& module, FSDPOptions options)
    : module_(module), state_(std::make_shared<State>(std::move(options))) {
  const dist::KeepAlive alive;  // drawing a large deferred model may outlast --hang-timeout
  State& s = *state_;
  s.self = state_;
  const UnitSpecs unit_specs = agree_on_units(module, s);
  start_replicas_equal(module, s);
  build_units(module, s, unit_specs);
  if (s.options.reproducible) install_reproducible(s);
  install_module_hooks(state_);
  install_readiness(state_);
  for (State::Unit& u : s.units) s.release(u);
  // The shards are what trains: an optimizer or a pipeline handed these raises, naming this.
  for (Tensor& p : s.params)
    p.impl()->meta().managed_by =
        "FullyShardedDataParallel (its flat shards train in their place: step "
        "fsdp.parameters(), or fsdp.param_groups(groups) for parameter groups)";
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  for (Tensor& p : state_->params) p.impl()->meta().managed_by.clear();
  for (HookHandle& hook : state_->module_hooks) hook.remove();
  for (const State::Unit& u : state_->units)
    for (const State::Flat& f : u.flats()) detail::remove_cut(f.shard, Cut::Kind::FlatShard);
}

void FullyShardedDataParallel::run(const std::function<void()>& body) {
  State& s = *state_;
  NoGradGuard no_grad;
  auto release_all = [&s] {
    for (State::Unit& u : s.units) s.release(u);
  };
  try {
    s.ensure_gathered(s.root());
    body();
  } catch (...) {
    release_all();
    throw;
  }
  release_all();
}

Tensor FullyShardedDataParallel::forward(const nn::Inputs& inputs) {
  State& s = *state_;
  const bool synchronizing = s.readiness->begin_forward(kFSDPOp, s.stats.steps);
  if (synchronizing) {
    detail::join_step_begins(this);
    dist::set_step(s.group, s.stats.steps);
    s.disagreements_seen = dist::disagreements(s.group);  // the step starts in step
  }
  s.new_forward(/*with_backward=*/autograd::GradMode::is_enabled());
  if (s.options.reproducible && autograd::GradMode::is_enabled())
    for (State::Unit& u : s.units)
      for (State::Flat& f : u.flats())
        if (f.sums) f.sums->note_rows(inputs);
  Tensor out;
  try {
    s.ensure_gathered(s.root());
    if (synchronizing) s.bind_grads(s.root());
    // A mixed-precision policy computes in param_dtype: the main input joins it (FSDP2's
    // cast_forward_inputs).
    const std::optional<DType> compute = s.options.param_dtype;
    out = compute && inputs.x.defined() && is_floating(inputs.x.dtype()) &&
                  inputs.x.dtype() != *compute
              ? module_(inputs.with(inputs.x.to(*compute)))
              : module_(inputs);
    const std::optional<DType> output = s.options.output_dtype;
    if (output && out.defined() && is_floating(out.dtype()) && out.dtype() != *output)
      out = out.to(*output);
  } catch (...) {
    // The peers' forward went on: pair their collectives, then let this rank's error out.
    try {
      s.abandon_forward(synchronizing);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[weave] rank %d: %s: settling the failed forward raised too: %s\n",
                   dist::rank(), kFSDPOp, e.what());
    }
    throw;
  }
  if (!s.order_known && !s.forward_order.empty()) s.order_known = true;
  if (!autograd::GradMode::is_enabled() || !out.requires_grad()) {
    for (State::Unit& u : s.units) s.release(u);  // no backward follows
  } else {
    if (synchronizing) {
      s.readiness->expect_backward();
      s.readiness->set_forward_output(out);
    }
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
  for (const auto& [name, shard] : state_->named_shards())
    if (shard.requires_grad()) out.push_back(shard);
  return out;
}

std::vector<std::string> FullyShardedDataParallel::shard_names() const {
  std::vector<std::string> out;
  for (const auto& [name, shard] : state_->named_shards())
    if (shard.requires_grad()) out.push_back(name);
  return out;
}

std::vector<std::string> FullyShardedDataParallel::unit_names() const {
  std::vector<std::string> out;
  for (const State::Unit& u : state_->units)
    if (!u.flats().empty()) out.push_back(u.name());
  return out;
}

NoSyncGuard FullyShardedDataParallel::no_sync() {
  return NoSyncGuard(state_->readiness);
}

double FullyShardedDataParallel::clip_grad_norm_(double max_norm, double norm_type,
                                                 bool error_if_nonfinite) {
  // The shards' placements say how many ranks hold each (padding holds zero gradients).
  return parallel::clip_grad_norm_(parameters(), max_norm, norm_type, state_->group,
                                   error_if_nonfinite);
}

const FSDPStats& FullyShardedDataParallel::stats() const {
  return state_->stats;
}

bool FullyShardedDataParallel::can_shadow_join_step() const {
  return state_->order_known;
}

void FullyShardedDataParallel::shadow_join_step() {
  state_->shadow_step();
}

void FullyShardedDataParallel::abandon_join_step() {
  state_->readiness->settle_skipped_backward(kFSDPOp, state_->stats.steps);
}

bool FullyShardedDataParallel::gradients_finite() const {
  return state_->finite;
}

const dist::Group& FullyShardedDataParallel::group() const {
  return state_->group;
}

}  // namespace weave::parallel

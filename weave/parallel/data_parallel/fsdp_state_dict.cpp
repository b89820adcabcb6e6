// FullyShardedDataParallel's views of its state: the full state dict (gathered on every rank),
// the module of this rank's shards that sharded checkpoints save, and the optimizer's parameter
// groups over the shards.
#include <map>
#include <unordered_map>

#include "weave/autograd/grad_mode.h"
#include "weave/ops/ops.h"
#include "weave/parallel/core/agree.h"
#include "weave/parallel/data_parallel/fsdp_state.h"

namespace weave::parallel {

namespace {

// A module that holds another's shards as its parameters and its buffers as its own, for the
// checkpoint code.
class ShardModule : public nn::Module {
 public:
  ShardModule(const nn::NamedTensors& shards, const nn::NamedTensors& buffers) {
    for (const auto& [name, t] : shards) register_parameter(name, t, t.requires_grad());
    for (const auto& [name, t] : buffers) register_buffer(name, t);
  }
  Tensor forward(const Tensor&) override {
    WEAVE_FAIL(kFSDPOp, "the sharded module holds shards for checkpoints; it has no forward");
  }
};

}  // namespace

nn::NamedTensors FullyShardedDataParallel::full_state_dict() {
  State& s = *state_;
  NoGradGuard no_grad;
  std::map<const void*, Tensor> values;
  for (State::Unit& u : s.units)
    for (State::Flat& f : u.flats()) {
      Tensor whole =
          empty(f.full.flat.shape(), {.dtype = f.shard.dtype(), .device = f.shard.device()});
      dist::all_gather(whole, f.shard.detach(), f.group);
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
  detail::check_together([&] { module_.check_state_dict(state, /*strict=*/true); }, s.group,
                         kFSDPOp);
  std::map<std::string, Tensor> by_name(state.begin(), state.end());
  NoGradGuard no_grad;
  for (State::Unit& u : s.units)
    for (State::Flat& f : u.flats()) {
      Tensor whole =
          zeros(f.full.flat.shape(), {.dtype = f.shard.dtype(), .device = f.shard.device()});
      for (size_t k = 0; k < f.params.size(); ++k)
        f.full.view_in(whole, k).copy_(by_name.at(s.names[size_t(f.params[k])]));
      f.shard.detach().copy_(whole.narrow(0, f.group.rank() * f.shard.numel(), f.shard.numel()));
    }
  for (auto& [name, b] : module_.named_buffers()) {
    Tensor target = b;
    target.copy_(by_name.at(name));
  }
}

Tensor FullyShardedDataParallel::trained_tensor_of(const Tensor& parameter) const {
  const State& s = *state_;
  for (const State::Unit& u : s.units)
    for (const State::Flat& f : u.flats())
      if (f.alone && !f.frozen && f.params.size() == 1 &&
          s.params[size_t(f.params[0])].impl() == parameter.impl())
        return f.shard;
  return {};
}

nn::Module& FullyShardedDataParallel::sharded_module() {
  if (!state_->shard_module)  // the frozen shards too: checkpoints and exports hold the base
    state_->shard_module =
        std::make_unique<ShardModule>(state_->named_shards(), module_.named_buffers());
  return *state_->shard_module;
}

std::vector<optim::ParamGroup> FullyShardedDataParallel::param_groups(
    const std::vector<optim::ParamGroup>& groups) const {
  const State& s = *state_;
  const char* op = "FullyShardedDataParallel.param_groups";
  // Which group each of the model's parameters is in.
  std::unordered_map<const TensorImpl*, size_t> index;
  for (size_t i = 0; i < s.params.size(); ++i) index.emplace(s.params[i].impl(), i);
  std::vector<int> group_of(s.params.size(), -1);
  for (size_t g = 0; g < groups.size(); ++g) {
    WEAVE_CHECK(groups[g].ranges.empty(), op,
                "group {} lists element ranges; hint: give the model's whole parameters", g);
    for (const Tensor& p : groups[g].params) {
      if (p.defined() && !p.requires_grad()) continue;  // frozen: its shard does not train
      auto found = p.defined() ? index.find(p.impl()) : index.end();
      WEAVE_CHECK(found != index.end(), op,
                  "group {} holds a tensor {} that is not a parameter of the wrapped model; hint: "
                  "build the groups from the model (optim::weight_decay_groups(model, ...))",
                  g, p.defined() ? p.shape().str() : "(undefined)");
      int& mine = group_of[found->second];
      WEAVE_CHECK(mine < 0, op, "parameter '{}' is in groups {} and {}", s.names[found->second],
                  mine, g);
      mine = int(g);
    }
  }
  for (size_t i = 0; i < s.params.size(); ++i)
    WEAVE_CHECK(group_of[i] >= 0 || !s.params[i].requires_grad(), op,
                "parameter '{}' is in no group; hint: every parameter of the model belongs to "
                "one group",
                s.names[i]);
  std::vector<optim::ParamGroup> out(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) out[g].weight_decay = groups[g].weight_decay;
  for (const State::Unit& unit : s.units)
    for (const State::Flat& f : unit.flats()) {
      if (f.frozen) continue;
      std::vector<int> member_groups;
      for (int i : f.params) member_groups.push_back(group_of[size_t(i)]);
      // The shard's offset in its flat over its own group (an expert flat's is the expert-data
      // group, not the FSDP group).
      f.full.add_shard_to_groups(out, f.shard, f.group.rank() * f.shard.numel(), member_groups);
    }
  return out;
}

}  // namespace weave::parallel

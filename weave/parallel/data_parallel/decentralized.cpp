// The decentralized trainer: per-bucket optimizer steps inside backward, asynchronous neighbour
// averages of each bucket's flat parameters completed at the next forward.
#include "weave/parallel/data_parallel/decentralized.h"

#include <algorithm>
#include <map>

#include "weave/autograd/grad_mode.h"
#include "weave/nn/deferred.h"
#include "weave/parallel/core/agree.h"
#include "weave/parallel/core/flat_buffer.h"
#include "weave/parallel/core/mesh.h"
#include "weave/parallel/core/placement.h"
#include "weave/parallel/core/readiness.h"
#include "weave/parallel/core/replicas.h"

namespace weave::parallel {

namespace {

// The edge of `phase` that holds group rank `rank`.
const std::vector<int>& edge_of(const TopologyPhase& phase, int rank) {
  for (const auto& edge : phase.edges)
    for (int r : edge)
      if (r == rank) return edge;
  WEAVE_FAIL("topology", "rank {} is in no edge of a phase", rank);
}

// The rank lists of every group the world's ranks train on, in order of their lowest rank: the
// world itself, or the sibling groups of a mesh (each rank passes its own). Collective over the
// world when `group` is not the world.
std::vector<std::vector<int>> sibling_groups(const dist::Group& group) {
  const int world = dist::world_size();
  if (group.size() == world) return {group.ranks()};
  std::vector<int64_t> mine(size_t(world), -1);
  for (size_t k = 0; k < group.ranks().size(); ++k) mine[k] = group.ranks()[k];
  Tensor all = empty({int64_t(world) * world}, {.dtype = kInt64});
  dist::all_gather(all, from_vector(mine), dist::world());
  const std::vector<int64_t> values = all.to_vector<int64_t>();
  std::vector<std::vector<int>> groups;
  for (int r = 0; r < world; ++r) {
    std::vector<int> ranks;
    for (int k = 0; k < world && values[size_t(r * world + k)] >= 0; ++k)
      ranks.push_back(int(values[size_t(r * world + k)]));
    if (std::find(groups.begin(), groups.end(), ranks) == groups.end()) groups.push_back(ranks);
  }
  return groups;
}

}  // namespace

struct DecentralizedDataParallel::State {
  struct Bucket {
    detail::FlatBuffer params;  // the bucket's parameters live here (bound after tracing)
    std::unique_ptr<optim::Optimizer> optimizer;
    // The neighbour average in flight: mixed = c * x summed over the edge; x <- self * x + mixed.
    Tensor mixed;
    dist::Work work;
    double self = 1;
    bool mixing = false;
  };
  struct PhaseGroup {
    std::optional<dist::Group> group;  // none for a rank alone in its edge
    double weight = 1;
    size_t edge_size = 1;
  };

  DecentralizedOptions options;
  dist::Group group;
  OptimizerFactory make_optimizer;
  std::vector<TopologyPhase> phases;
  std::vector<PhaseGroup> my_phase;
  std::vector<Tensor> params;
  std::vector<Bucket> buckets;
  std::shared_ptr<detail::GradReadiness> readiness;
  bool failing = false;  // finishing a backward that unwound on this rank
  int64_t step = 0;

  explicit State(DecentralizedOptions o)
      : options(std::move(o)),
        group(detail::data_parallel_group(options.group, "DecentralizedDataParallel")) {}

  void watch() {
    readiness = detail::GradReadiness::create(
        params, {.launch = [this](int b) { step_and_mix(buckets[size_t(b)]); },
                 .finish = [this](bool failed) { finish(failed); }});
  }

  // With a loss scaler, the bucket's gradients are unscaled first, and a bucket holding
  // inf/NaN keeps its parameters (the scaler's update() agrees on the backoff over the world).
  // A rank whose backward failed drops the partial gradients without stepping, but still sends
  // its averages: the neighbours wait for them, and every rank stays in the same phase.
  void step_and_mix(Bucket& b) {
    if (!failing) {
      if (options.lr_schedule) b.optimizer->set_lr(options.lr_schedule(step));
      bool finite = true;
      if (options.scaler) {
        std::vector<Tensor> grads;
        for (const Tensor& p : b.optimizer->params()) grads.push_back(p.grad());
        finite = options.scaler->unscale_local(grads);
      }
      if (finite) b.optimizer->step();
    }
    b.optimizer->zero_grad(true);
    launch_mixing(b);
  }

  void launch_mixing(Bucket& b) {
    const PhaseGroup& phase = my_phase[size_t(step) % my_phase.size()];
    if (!phase.group) return;  // alone in this phase's edge: nothing to mix
    const double others = (1 - phase.weight) / double(phase.edge_size - 1);
    NoGradGuard no_grad;
    b.mixed = b.params.flat * others;
    b.self = phase.weight - others;
    b.work = dist::all_reduce(b.mixed, dist::ReduceOp::Sum, *phase.group, /*async_op=*/true);
    b.mixing = true;
  }

  void complete_mixing() {
    NoGradGuard no_grad;
    for (Bucket& b : buckets) {
      if (!b.mixing) continue;
      b.work.wait();
      b.params.flat.mul_(b.self).add_(b.mixed);
      b.mixing = false;
      b.mixed = Tensor();
    }
  }

  // Returns false (on every rank) when some rank's first backward failed: nothing is built,
  // the next backward traces again.
  bool build_buckets(bool failed) {
    bool differs = false;
    std::vector<int64_t> failed_ranks = {failed ? 1 : 0};
    std::vector<int> trace = readiness->take_trace();
    const std::vector<int> order = detail::agree_on_order(
        failed ? std::vector<int>{} : trace, params.size(), group, differs, &failed_ranks);
    if (failed_ranks[0] > 0) {
      optim::zero_grad(params, /*set_to_none=*/false);
      WEAVE_CHECK(failed, "DecentralizedDataParallel",
                  "{} rank(s) failed in the first backward (see their error); no rank stepped",
                  failed_ranks[0]);
      return false;
    }
    WEAVE_CHECK(!differs, "DecentralizedDataParallel",
                "ranks produced gradients in different orders in the first backward; hint: "
                "every rank must run the same model code on inputs of the same structure");
    std::vector<std::vector<int>> members =
        detail::cut_buckets(order, params, options.first_bucket_mb, options.bucket_mb);
    for (const std::vector<int>& bucket_members : members) {
      Bucket b;
      std::vector<Tensor> bucket_params;
      for (int i : bucket_members) bucket_params.push_back(params[size_t(i)]);
      b.params = detail::FlatBuffer::adopt(bucket_params);
      b.optimizer = make_optimizer(bucket_params);
      WEAVE_CHECK(b.optimizer != nullptr, "DecentralizedDataParallel",
                  "the optimizer factory returned null");
      buckets.push_back(std::move(b));
    }
    readiness->set_buckets(std::move(members));
    return true;
  }

  // End of a stepping backward: buckets that are not complete (parameters without a gradient)
  // step with what they have, and every bucket's neighbour average goes out.
  void finish(bool failed) {
    NoGradGuard no_grad;
    if (!readiness->has_buckets() && !build_buckets(failed)) return;
    failing = failed;
    readiness->launch_rest();
    failing = false;
    ++step;
  }
};

DecentralizedDataParallel::DecentralizedDataParallel(nn::Module& module,
                                                     OptimizerFactory make_optimizer,
                                                     DecentralizedOptions options)
    : module_(module), state_(std::make_shared<State>(std::move(options))) {
  State& s = *state_;
  const char* op = "DecentralizedDataParallel";
  WEAVE_CHECK(make_optimizer != nullptr, op, "expected an optimizer factory");
  detail::check_bucket_sizes(op, s.options.first_bucket_mb, s.options.bucket_mb);
  WEAVE_CHECK(s.group.rank() >= 0, op,
              "rank {} is not in group {}; hint: only its members construct the wrapper",
              dist::rank(), s.group.str());
  s.make_optimizer = std::move(make_optimizer);
  s.phases = topology_phases(s.options.topology, s.group.size(), s.options.local_ranks);
  detail::check_same_model(module, s.group, op);
  {
    std::vector<std::string> names;
    std::vector<Tensor> params;
    for (const auto& [name, p] : module.named_parameters())
      names.push_back(name), params.push_back(p);
    detail::check_replicated(names, params, s.group, op, detail::kTrainExpertsHint);
  }
  // each rank holds the whole model: a deferred one is drawn here (its seed agreed)
  const dist::KeepAlive alive;  // drawing a large deferred model may outlast --hang-timeout
  detail::materialize_replicas(module, s.group, op);
  broadcast_parameters(module, 0, s.group);
  // Every rank of the world creates every edge group of every sibling group, in one order
  // (new_group is collective over the world); an edge that recurs is created once.
  std::map<std::vector<int>, dist::Group> edges;
  for (const std::vector<int>& ranks : sibling_groups(s.group))
    for (const TopologyPhase& phase : s.phases)
      for (const auto& edge : phase.edges) {
        std::vector<int> global;
        for (int r : edge) global.push_back(ranks[size_t(r)]);
        if (global.size() > 1 && !edges.count(global))
          edges.emplace(global, dist::new_group(global));
      }
  for (const TopologyPhase& phase : s.phases) {
    const std::vector<int>& mine = edge_of(phase, s.group.rank());
    State::PhaseGroup pg;
    pg.weight = phase.weight;
    pg.edge_size = mine.size();
    std::vector<int> global;
    for (int r : mine) global.push_back(s.group.global_rank(r));
    if (mine.size() > 1) pg.group = edges.at(global);
    s.my_phase.push_back(pg);
  }
  for (const auto& [name, p] : module.named_parameters())
    if (p.defined() && p.requires_grad()) s.params.push_back(p);
  s.watch();
}

DecentralizedDataParallel::~DecentralizedDataParallel() {
  state_->readiness.reset();
  try {
    state_->complete_mixing();  // no all_reduce may outlive the buffers it writes
  } catch (...) {
  }
}

Tensor DecentralizedDataParallel::forward(const nn::Inputs& inputs) {
  // Inside join(), a forward whose backward steps counts the ranks still training.
  if (autograd::GradMode::is_enabled() && !state_->readiness->paused())
    detail::join_step_begins(this);
  state_->complete_mixing();
  return module_(inputs);
}

bool DecentralizedDataParallel::can_shadow_join_step() const {
  return state_->readiness->has_buckets();
}

void DecentralizedDataParallel::shadow_join_step() {
  State& s = *state_;
  s.complete_mixing();
  for (State::Bucket& b : s.buckets) s.launch_mixing(b);
  ++s.step;
}

void DecentralizedDataParallel::set_accumulate_grad(bool accumulate) {
  state_->readiness->set_paused(accumulate);
}

void DecentralizedDataParallel::wait() {
  state_->complete_mixing();
}

void DecentralizedDataParallel::global_avg() {
  state_->complete_mixing();
  average_tensors(state_->params, state_->group);
}

int64_t DecentralizedDataParallel::steps() const {
  return state_->step;
}

const std::vector<TopologyPhase>& DecentralizedDataParallel::phases() const {
  return state_->phases;
}

const dist::Group& DecentralizedDataParallel::group() const {
  return state_->group;
}

}  // namespace weave::parallel

// Topologies and the decentralized trainer: per-bucket steps inside backward, asynchronous
// neighbour averages completed at the next forward.
#include "weave/parallel/decentralized.h"

#include <map>
#include <mutex>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/parallel/buckets.h"
#include "weave/parallel/ddp.h"
#include "weave/parallel/distributed_optimizer.h"

namespace weave::parallel {

// ---- topologies ----------------------------------------------------------------------------

namespace {

using PhaseMaker = std::function<std::vector<TopologyPhase>(int world, int local_ranks)>;

bool power_of_two(int n) {
  return n > 0 && (n & (n - 1)) == 0;
}
int log2_of(int n) {
  int k = 0;
  while ((1 << k) < n) ++k;
  return k;
}

std::vector<TopologyPhase> complete(int n, int) {
  std::vector<int> all(size_t(n), 0);
  for (int i = 0; i < n; ++i) all[size_t(i)] = i;
  return {{{all}, 1.0 / n}};
}

std::vector<TopologyPhase> ring(int n, int) {
  WEAVE_CHECK(n >= 2 && n % 2 == 0, "topology",
              "ring needs an even world size, found world size {}; hint: use complete or "
              "one-peer-exp",
              n);
  TopologyPhase forward{{}, 0.5}, backward{{}, 0.5};
  for (int i = 0; i < n; i += 2) {
    forward.edges.push_back({i, i + 1});
    backward.edges.push_back({i, (i + n - 1) % n});
  }
  return {forward, backward};
}

std::vector<TopologyPhase> one_peer_exp(int n, int) {
  WEAVE_CHECK(n >= 2 && power_of_two(n), "topology",
              "one-peer-exp needs a power-of-two world size of at least 2, found world size {}", n);
  std::vector<TopologyPhase> phases;
  for (int bit = 1; bit < n; bit <<= 1) {
    TopologyPhase phase{{}, 0.5};
    for (int j = 0; j < n; ++j)
      if ((j & bit) == 0) phase.edges.push_back({j, j + bit});
    phases.push_back(phase);
  }
  return phases;
}

std::vector<TopologyPhase> alternating_exp_ring(int n, int local) {
  WEAVE_CHECK(local >= 1 && n % local == 0 && power_of_two(n / local) && n / local >= 2, "topology",
              "alternating-exp-ring needs local_ranks ({}) to divide the world size ({}) into a "
              "power-of-two number (>= 2) of nodes",
              local, n);
  const int nodes = n / local;
  auto ranks_of = [&](int node) {
    std::vector<int> ranks;
    for (int l = 0; l < local; ++l) ranks.push_back(node * local + l);
    return ranks;
  };
  std::vector<TopologyPhase> phases;
  for (int i = 0; i < log2_of(nodes); ++i) {
    TopologyPhase intra{{}, 1.0 / local};
    for (int node = 0; node < nodes; ++node) intra.edges.push_back(ranks_of(node));
    TopologyPhase inter{{}, 1.0 / (2 * local)};
    for (int node = 0; node < nodes; ++node)
      if ((node & (1 << i)) == 0) {
        std::vector<int> edge = ranks_of(node), other = ranks_of(node | (1 << i));
        edge.insert(edge.end(), other.begin(), other.end());
        inter.edges.push_back(edge);
      }
    phases.push_back(intra);
    phases.push_back(inter);
  }
  return phases;
}

struct Registry {
  std::mutex mutex;
  std::map<std::string, PhaseMaker> makers{{"complete", complete},
                                           {"ring", ring},
                                           {"one-peer-exp", one_peer_exp},
                                           {"alternating-exp-ring", alternating_exp_ring}};
};
Registry& registry() {
  static Registry r;
  return r;
}

// The edge of `phase` that holds `rank`.
const std::vector<int>& edge_of(const TopologyPhase& phase, int rank) {
  for (const auto& edge : phase.edges)
    for (int r : edge)
      if (r == rank) return edge;
  WEAVE_FAIL("topology", "rank {} is in no edge of a phase", rank);
}

}  // namespace

std::vector<std::string> topology_names() {
  std::lock_guard lock(registry().mutex);
  std::vector<std::string> names;
  for (const auto& [name, maker] : registry().makers) names.push_back(name);
  return names;
}

void register_topology(const std::string& name, PhaseMaker make_phases) {
  WEAVE_CHECK(!name.empty() && make_phases, "register_topology",
              "expected a name and a phase function");
  std::lock_guard lock(registry().mutex);
  registry().makers[name] = std::move(make_phases);
}

std::vector<TopologyPhase> topology_phases(const std::string& name, int world, int local_ranks) {
  PhaseMaker maker;
  {
    std::lock_guard lock(registry().mutex);
    auto it = registry().makers.find(name);
    if (it != registry().makers.end()) maker = it->second;
  }
  WEAVE_CHECK(maker != nullptr, "topology", "unknown topology '{}'; registered: {}", name,
              topology_names());
  WEAVE_CHECK(world >= 1, "topology", "world size must be positive, found {}", world);
  std::vector<TopologyPhase> phases = maker(world, local_ranks);
  WEAVE_CHECK(!phases.empty(), "topology", "topology '{}' has no phase for world size {}", name,
              world);
  for (size_t p = 0; p < phases.size(); ++p) {  // every rank in exactly one edge per phase
    std::vector<int> seen(size_t(world), 0);
    for (const auto& edge : phases[p].edges)
      for (int r : edge) {
        WEAVE_CHECK(r >= 0 && r < world, "topology", "{} phase {} names rank {} of {}", name, p, r,
                    world);
        ++seen[size_t(r)];
      }
    for (int r = 0; r < world; ++r)
      WEAVE_CHECK(seen[size_t(r)] == 1, "topology",
                  "{} phase {} puts rank {} in {} edges; every rank needs exactly one", name, p, r,
                  seen[size_t(r)]);
    WEAVE_CHECK(phases[p].weight > 0 && phases[p].weight <= 1, "topology",
                "{} phase {} has weight {}; expected (0, 1]", name, p, phases[p].weight);
  }
  return phases;
}

std::vector<std::vector<double>> mixing_matrix(const TopologyPhase& phase, int world) {
  std::vector<std::vector<double>> m(size_t(world), std::vector<double>(size_t(world), 0.0));
  for (const auto& edge : phase.edges) {
    const double others = edge.size() > 1 ? (1 - phase.weight) / double(edge.size() - 1) : 0;
    for (int i : edge)
      for (int j : edge)
        m[size_t(i)][size_t(j)] = i == j ? (edge.size() > 1 ? phase.weight : 1.0) : others;
  }
  return m;
}

// ---- the trainer ---------------------------------------------------------------------------

struct DecentralizedDataParallel::State {
  struct Bucket {
    std::vector<int> params;
    std::unique_ptr<optim::Optimizer> optimizer;
    int pending = 0;
    bool stepped = false;
    // The neighbour average in flight: buf = c * x summed over the edge; x <- self * x + buf.
    Tensor buffer;
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
  OptimizerFactory make_optimizer;
  std::vector<TopologyPhase> phases;
  std::vector<PhaseGroup> my_phase;
  std::vector<Tensor> params;
  std::vector<int> bucket_of;
  std::vector<Bucket> buckets;
  std::vector<HookHandle> hooks;
  std::vector<int> trace;
  std::vector<char> ready;
  bool traced = false, accumulate = false, in_backward = false;
  size_t next_launch = 0;
  int64_t step = 0;

  void on_ready(int i, const std::weak_ptr<State>& self) {
    if (accumulate) return;
    if (!in_backward) {
      in_backward = true;
      std::fill(ready.begin(), ready.end(), 0);
      next_launch = 0;
      for (Bucket& b : buckets) {
        b.pending = int(b.params.size());
        b.stepped = false;
      }
      // Runs also when an exception unwinds backward: the next step must start clean.
      autograd::queue_final_callback([self](bool failed) {
        if (auto state = self.lock()) state->finish(failed);
      });
    }
    if (ready[size_t(i)]) return;
    ready[size_t(i)] = 1;
    if (!traced) {
      trace.push_back(i);
      return;
    }
    Bucket& b = buckets[size_t(bucket_of[size_t(i)])];
    if (--b.pending == 0) step_bucket(b);
    launch_stepped();
  }

  // With a loss scaler, the bucket's gradients are unscaled first, and a bucket holding
  // inf/NaN keeps its parameters (the scaler's update() agrees on the backoff over the world).
  void step_bucket(Bucket& b) {
    if (options.lr_schedule) b.optimizer->set_lr(options.lr_schedule(step));
    bool finite = true;
    if (options.scaler) {
      std::vector<Tensor> grads;
      for (const Tensor& p : b.optimizer->params()) grads.push_back(p.grad());
      finite = options.scaler->unscale_local(grads);
    }
    if (finite) b.optimizer->step();
    b.optimizer->zero_grad(true);
    b.stepped = true;
  }

  // Neighbour averages go out in bucket order (the same on every rank of an edge).
  void launch_stepped() {
    while (next_launch < buckets.size() && buckets[next_launch].stepped)
      launch_mixing(buckets[next_launch++]);
  }

  void launch_mixing(Bucket& b) {
    const PhaseGroup& phase = my_phase[size_t(step) % my_phase.size()];
    if (!phase.group) return;  // alone in this phase's edge: nothing to mix
    const double others = (1 - phase.weight) / double(phase.edge_size - 1);
    std::vector<Tensor> pieces;
    for (int i : b.params) pieces.push_back(params[size_t(i)].reshape({-1}));
    b.buffer = cat(pieces) * others;
    b.self = phase.weight - others;
    b.work = dist::all_reduce(b.buffer, dist::ReduceOp::Sum, *phase.group, /*async_op=*/true);
    b.mixing = true;
  }

  void complete_mixing() {
    NoGradGuard no_grad;
    for (Bucket& b : buckets) {
      if (!b.mixing) continue;
      b.work.wait();
      int64_t offset = 0;
      for (int i : b.params) {
        Tensor& p = params[size_t(i)];
        p.mul_(b.self).add_(b.buffer.narrow(0, offset, p.numel()).reshape(p.shape()));
        offset += p.numel();
      }
      b.mixing = false;
      b.buffer = Tensor();
    }
  }

  // Returns false (on every rank) when some rank's first backward failed: nothing is built,
  // the next backward traces again.
  bool build_buckets(bool failed) {
    bool differs = false;
    std::vector<int64_t> failed_ranks = {failed ? 1 : 0};
    const std::vector<int> order = detail::agree_on_order(
        failed ? std::vector<int>{} : trace, params.size(), dist::world(), differs, &failed_ranks);
    trace.clear();
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
    bucket_of.assign(params.size(), -1);
    for (const auto& members :
         detail::cut_buckets(order, params, options.first_bucket_mb, options.bucket_mb)) {
      Bucket b;
      b.params = members;
      std::vector<Tensor> bucket_params;
      for (int i : members) {
        bucket_of[size_t(i)] = int(buckets.size());
        bucket_params.push_back(params[size_t(i)]);
      }
      b.optimizer = make_optimizer(bucket_params);
      WEAVE_CHECK(b.optimizer != nullptr, "DecentralizedDataParallel",
                  "the optimizer factory returned null");
      buckets.push_back(std::move(b));
    }
    traced = true;
    return true;
  }

  // End of a stepping backward: buckets that are not complete (parameters without a gradient)
  // step with what they have, and every bucket's neighbour average goes out. When this rank's
  // backward failed, its incomplete buckets do not step (their gradients are partial and are
  // dropped), but their averages still go out: the neighbours wait for them, and every rank
  // stays in the same phase.
  void finish(bool failed) {
    in_backward = false;
    NoGradGuard no_grad;
    if (!traced && !build_buckets(failed)) return;
    for (Bucket& b : buckets)
      if (!b.stepped) {
        if (failed) {
          b.optimizer->zero_grad(true);
          b.stepped = true;
        } else {
          step_bucket(b);
        }
      }
    launch_stepped();
    ++step;
  }
};

DecentralizedDataParallel::DecentralizedDataParallel(nn::Module& module,
                                                     OptimizerFactory make_optimizer,
                                                     DecentralizedOptions options)
    : module_(module), state_(std::make_shared<State>()) {
  State& s = *state_;
  WEAVE_CHECK(make_optimizer != nullptr, "DecentralizedDataParallel",
              "expected an optimizer factory");
  s.options = std::move(options);
  s.make_optimizer = std::move(make_optimizer);
  const int world = dist::world_size(), me = dist::rank();
  s.phases = topology_phases(s.options.topology, world, s.options.local_ranks);
  check_same_model(module);
  synchronize(module);
  // Every rank creates every edge's group, in the same order (new_group is collective);
  // an edge that recurs in several phases is created once.
  std::map<std::vector<int>, dist::Group> groups;
  for (const TopologyPhase& phase : s.phases) {
    for (const auto& edge : phase.edges)
      if (edge.size() > 1 && !groups.count(edge)) groups.emplace(edge, dist::new_group(edge));
    const std::vector<int>& mine = edge_of(phase, me);
    State::PhaseGroup pg;
    pg.weight = phase.weight;
    pg.edge_size = mine.size();
    if (mine.size() > 1) pg.group = groups.at(mine);
    s.my_phase.push_back(pg);
  }
  for (const auto& [name, p] : module.named_parameters())
    if (p.defined() && p.requires_grad()) s.params.push_back(p);
  s.ready.assign(s.params.size(), 0);
  s.hooks = detail::hook_ready(s.params, state_);
}

DecentralizedDataParallel::~DecentralizedDataParallel() {
  for (HookHandle& hook : state_->hooks) hook.remove();
  try {
    state_->complete_mixing();  // no all_reduce may outlive the buffers it writes
  } catch (...) {
  }
}

Tensor DecentralizedDataParallel::forward(const Tensor& input) {
  state_->complete_mixing();
  return module_(input);
}

void DecentralizedDataParallel::set_accumulate_grad(bool accumulate) {
  state_->accumulate = accumulate;
}

void DecentralizedDataParallel::wait() {
  state_->complete_mixing();
}

void DecentralizedDataParallel::global_avg() {
  state_->complete_mixing();
  average_tensors(state_->params, dist::world());
}

int64_t DecentralizedDataParallel::steps() const {
  return state_->step;
}

const std::vector<TopologyPhase>& DecentralizedDataParallel::phases() const {
  return state_->phases;
}

}  // namespace weave::parallel

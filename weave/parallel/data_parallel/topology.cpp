// The topology registry: built-in phase cycles, user registrations, and their checks.
#include "weave/parallel/data_parallel/topology.h"

#include <map>
#include <mutex>

#include "weave/tensor/error.h"

namespace weave::parallel {

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

}  // namespace weave::parallel

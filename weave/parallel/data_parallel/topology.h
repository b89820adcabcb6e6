#pragma once
// Topologies of decentralized training: which ranks average with which in each step.
//
// A topology is a cycle of phases. A phase is a set of edges (rank sets) with a weight w; every
// rank is in exactly one edge per phase, and step t uses phase t mod (number of phases). On an
// edge R, rank i mixes
//   x_i <- w x_i + (1 - w) / (|R| - 1) * sum_{j in R, j != i} x_j
// (each phase's mixing matrix is doubly stochastic and symmetric). Ranks are positions in the
// group that trains (the world's ranks when it is the world).
#include <functional>
#include <string>
#include <vector>

namespace weave::parallel {

/// One phase: edges (group ranks) with the phase's self-weight w.
struct TopologyPhase {
  std::vector<std::vector<int>> edges;
  double weight = 0.5;
};

/// A topology's phases for a group of `world` ranks; `local_ranks` is the number of ranks per node
/// (alternating-exp-ring only). Names: "complete", "ring" (even world size), "one-peer-exp"
/// (power-of-two world size), "alternating-exp-ring" (local_ranks per node, a power-of-two
/// number of nodes). An unsupported world size raises weave::Error naming both.
std::vector<TopologyPhase> topology_phases(const std::string& name, int world, int local_ranks = 1);
/// The registered topology names.
std::vector<std::string> topology_names();
/// Registers a topology under `name` (for example, one of your own design).
void register_topology(
    const std::string& name,
    std::function<std::vector<TopologyPhase>(int world, int local_ranks)> make_phases);
/// The mixing matrix of one phase: M[i][j] is rank j's share in rank i's new value.
std::vector<std::vector<double>> mixing_matrix(const TopologyPhase& phase, int world);

}  // namespace weave::parallel

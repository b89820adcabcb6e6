// Decentralized topologies: every phase's mixing matrix is doubly stochastic and symmetric,
// every rank sits in exactly one edge per phase, and unsupported world sizes are named.
#include <cmath>

#include "helpers.h"

using namespace weave;

TEST_SUITE("topology") {
  TEST_CASE("every phase mixes with a doubly stochastic, symmetric matrix") {
    struct Case {
      std::string name;
      int world, local;
      size_t phases;
    };
    for (const Case& c :
         {Case{"complete", 1, 1, 1}, Case{"complete", 5, 1, 1}, Case{"ring", 2, 1, 2},
          Case{"ring", 6, 1, 2}, Case{"one-peer-exp", 2, 1, 1}, Case{"one-peer-exp", 8, 1, 3},
          Case{"alternating-exp-ring", 8, 2, 4}, Case{"alternating-exp-ring", 4, 1, 4}}) {
      CAPTURE(c.name);
      CAPTURE(c.world);
      auto phases = parallel::topology_phases(c.name, c.world, c.local);
      CHECK(phases.size() == c.phases);
      for (const auto& phase : phases) {
        auto m = parallel::mixing_matrix(phase, c.world);
        for (int i = 0; i < c.world; ++i) {
          double row = 0, column = 0;
          for (int j = 0; j < c.world; ++j) {
            row += m[i][j];
            column += m[j][i];
            CHECK(m[i][j] == doctest::Approx(m[j][i]));
            CHECK(m[i][j] >= 0);
          }
          CHECK(row == doctest::Approx(1.0));
          CHECK(column == doctest::Approx(1.0));
        }
      }
    }
  }

  TEST_CASE("the edges of each topology") {
    auto ring = parallel::topology_phases("ring", 4);
    CHECK(ring[0].edges == std::vector<std::vector<int>>{{0, 1}, {2, 3}});
    CHECK(ring[1].edges == std::vector<std::vector<int>>{{0, 3}, {2, 1}});
    CHECK(ring[0].weight == 0.5);
    auto exp = parallel::topology_phases("one-peer-exp", 4);
    CHECK(exp[1].edges == std::vector<std::vector<int>>{{0, 2}, {1, 3}});
    auto alt = parallel::topology_phases("alternating-exp-ring", 8, 2);
    CHECK(alt[0].edges.size() == 4);  // intra-node: the 4 nodes of 2 ranks, w = 1/2
    CHECK(alt[0].weight == 0.5);
    CHECK(alt[3].edges == std::vector<std::vector<int>>{{0, 1, 4, 5}, {2, 3, 6, 7}});
    CHECK(alt[3].weight == 0.25);  // inter-node: node j with node j XOR 2, w = 1/(2L)
    auto complete = parallel::topology_phases("complete", 3);
    CHECK(complete[0].weight == doctest::Approx(1.0 / 3));
  }

  TEST_CASE("unsupported world sizes and unknown names raise, naming both") {
    CHECK_WEAVE_ERROR(parallel::topology_phases("ring", 3), "topology", "even world size");
    CHECK_WEAVE_ERROR(parallel::topology_phases("one-peer-exp", 6), "topology", "6");
    CHECK_WEAVE_ERROR(parallel::topology_phases("alternating-exp-ring", 6, 2), "topology",
                      "local_ranks (2)");
    CHECK_WEAVE_ERROR(parallel::topology_phases("torus", 4), "topology", "unknown topology");
    parallel::register_topology("pairs-only", [](int world, int) {
      parallel::TopologyPhase phase{{}, 0.5};
      for (int i = 0; i + 1 < world; i += 2) phase.edges.push_back({i, i + 1});
      return std::vector<parallel::TopologyPhase>{phase};
    });
    CHECK(parallel::topology_phases("pairs-only", 4).size() == 1);
    // A registered topology that leaves a rank out is rejected.
    CHECK_WEAVE_ERROR(parallel::topology_phases("pairs-only", 5), "topology", "rank 4");
  }
}

#pragma once
// What verify_layout gathered of both runs (internal to verify_layout.cpp), and the diagnosis
// that reads it: the first quantity that diverged and the seam that most likely caused it.
#include <string>
#include <vector>

#include "weave/nn/module.h"
#include "weave/parallel/compose/verify_layout.h"

namespace weave::parallel::detail {

/// One side's step, whole, by weave's parameter names (the model's order).
struct StepRecord {
  nn::NamedTensors initial, gradients, after;
  double loss = 0, norm = 0;
};

/// Everything verify_layout knows at world rank 0 once both sides ran (or the layout raised).
struct LayoutFacts {
  StepRecord reference, layout;
  /// The norm each rank's clip returned, in world-rank order.
  std::vector<double> layout_norms;
  /// How far the layout got: its steps in order, the last one having raised when `raised`.
  std::string raised_step, raised_message;
  /// What the ranks' shares of the batch showed wrong (sampler group), or "".
  std::string inputs_problem;
  /// A parameter piece whose gradient copies differ across ranks, and the ranks on each side.
  std::string differing_copies, copy_sides;
  /// Name prefixes of the model's mixtures of experts ("blocks.0.moe."); their routers' are
  /// these followed by "router.".
  std::vector<std::string> mixtures;
  int context = 1;
  double tolerance = 1e-10;
  /// Which of the records were taken (a step that raised leaves the later ones out).
  bool have_initial = false, have_loss = false, have_gradients = false, have_after = false;
};

/// The report: passed, or the first divergence and its likely seam.
LayoutReport diagnose(const LayoutFacts& facts);

}  // namespace weave::parallel::detail

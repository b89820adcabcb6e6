// Cutting a model into pipeline stages: consecutive children balanced by parameter count (or
// at given boundaries), and the chunks of an interleaved pipeline.
#include <cmath>

#include "weave/parallel/model_parallel/pipeline.h"

namespace weave::parallel {

std::shared_ptr<nn::Sequential> pipeline_stage(const nn::Sequential& model, int stage, int stages,
                                               const std::vector<size_t>& boundaries) {
  auto children = model.named_children();
  const size_t n = children.size();
  WEAVE_CHECK(stages >= 1 && stage >= 0 && stage < stages, "pipeline_stage",
              "stage {} of {} is out of range", stage, stages);
  WEAVE_CHECK(n >= size_t(stages), "pipeline_stage",
              "the model has {} layers, fewer than the {} stages; hint: use fewer stages", n,
              stages);
  std::vector<size_t> cuts;  // cuts[j]: first child of stage j + 1
  if (!boundaries.empty()) {
    WEAVE_CHECK(boundaries.size() == size_t(stages - 1), "pipeline_stage",
                "expected {} boundaries for {} stages, found {}", stages - 1, stages,
                boundaries.size());
    for (size_t j = 0; j < boundaries.size(); ++j)
      WEAVE_CHECK(boundaries[j] > (j ? boundaries[j - 1] : 0) && boundaries[j] < n,
                  "pipeline_stage",
                  "boundaries must increase strictly within (0, {}), found {} at position {}", n,
                  boundaries[j], j);
    cuts = boundaries;
  } else {
    // balance parameter counts: cut where the running count is nearest to j / stages of it
    std::vector<double> prefix{0};
    for (const auto& [name, child] : children) {
      double count = 0;
      for (const Tensor& t : child->parameters()) count += double(t.numel());
      prefix.push_back(prefix.back() + count);
    }
    size_t previous = 0;
    for (int j = 1; j < stages; ++j) {
      const double goal = prefix.back() * j / stages;
      size_t best = previous + 1;
      for (size_t i = previous + 1; i + (stages - j) <= n; ++i)
        if (std::abs(prefix[i] - goal) <= std::abs(prefix[best] - goal)) best = i;
      cuts.push_back(best);
      previous = best;
    }
  }
  const size_t first = stage == 0 ? 0 : cuts[stage - 1];
  const size_t last = stage == stages - 1 ? n : cuts[stage];
  auto part = std::make_shared<nn::Sequential>();
  for (size_t i = first; i < last; ++i) part->push_back(children[i].second);
  return part;
}

std::vector<std::shared_ptr<nn::Sequential>> pipeline_chunks(const nn::Sequential& model, int rank,
                                                             int ranks, int virtual_stages) {
  WEAVE_CHECK(ranks >= 1 && virtual_stages >= 1 && rank >= 0 && rank < ranks, "pipeline_chunks",
              "rank {} of {} with {} virtual stages is out of range", rank, ranks, virtual_stages);
  std::vector<std::shared_ptr<nn::Sequential>> chunks;
  for (int c = 0; c < virtual_stages; ++c)
    chunks.push_back(pipeline_stage(model, c * ranks + rank, ranks * virtual_stages));
  return chunks;
}

}  // namespace weave::parallel

// What the stages of a pipeline agree on: the seed their parameters were drawn with, which
// parameters the first and the last stage both hold (and the sum of their gradients), and
// whether any stage's wrapper found NaN or infinity in a step.
#include "weave/parallel/model_parallel/pipeline.h"

#include <limits>
#include <set>

#include "weave/autograd/grad_mode.h"
#include "weave/ops/ops.h"
#include "weave/parallel/core/agree.h"
#include "weave/parallel/core/placement.h"
#include "weave/parallel/core/replicas.h"
#include "weave/tensor/tensor_impl.h"

namespace weave::parallel {

void Pipeline::agree_on_seed() {
  std::vector<Tensor> params;
  for (nn::Module* chunk : chunks_)
    for (const Tensor& p : chunk->parameters()) params.push_back(p);
  // Shared over the stages' data-parallel groups too: every pipeline of a mesh raises together.
  detail::Verdict verdict("Pipeline");
  detail::agree_on_seeds(detail::init_seeds(params), group_, verdict);
  for (DataParallelWrapper* wrapper : wrappers_)
    if (wrapper) verdict.share(wrapper->group());
  verdict.share(group_);
  verdict.raise_if_failed();
}

void Pipeline::place_parameters() {
  auto is_tied = [](const Tensor& p) {
    const Placement* placement = placement_of(p);
    return placement != nullptr && placement->tied_across_stages;
  };
  // A tied parameter's gradients are summed across the ends, where its wrapper trains it (FSDP:
  // a vocabulary piece's own shard); a wrapper that trains it only within flat shards of several
  // parameters would never see that sum.
  tied_.clear();
  std::set<const void*> standing_in;  // a wrapper's tensors trained for tied parameters
  bool tied_behind_wrapper = false;
  for (size_t c = 0; c < chunks_.size(); ++c)
    for (const Tensor& p : chunks_[c]->parameters()) {
      if (!is_tied(p) || !p.requires_grad()) continue;  // frozen: a base under adapters
      const Tensor trained = wrappers_[c] ? wrappers_[c]->trained_tensor_of(p) : p;
      tied_behind_wrapper |= !trained.defined();
      if (!trained.defined()) continue;
      tied_.push_back(trained);
      if (trained.impl() != p.impl()) standing_in.insert(trained.impl());
    }
  // The ends must hold as many tied parameters, the stages between none.
  const bool at_end = is_first() || is_last(), end = at_end && stages() > 1;
  const int64_t n = int64_t(tied_.size()), kAbove = std::numeric_limits<int32_t>::max();
  const detail::ValueRange tied = detail::check_together(
      [] {}, group_, "Pipeline",
      {end ? n : -1, end ? n : kAbove, at_end ? 0 : n, tied_behind_wrapper ? 1 : 0});
  WEAVE_CHECK(tied.highest[3] == 0, "Pipeline",
              "parameters tied across the first and the last stage are trained through a "
              "wrapper's own tensors (FSDP's shards) on some stage, which the pipeline's sum of "
              "their gradients cannot reach; hint: wrap such stages in DistributedDataParallel, "
              "or untie the head");
  WEAVE_CHECK(tied.highest[2] == 0 && (tied.highest[0] < 0 || tied.highest[0] == tied.lowest[1]),
              "Pipeline",
              "parameters tied across the first and the last stage: the ends hold {} and {} that "
              "train, the stages between up to {} (this stage: {}); hint: mark the same "
              "parameters on the first and the last stage (tie_first_and_last_stage), none "
              "between, and freeze them on both or neither",
              tied.lowest[1] == kAbove ? 0 : tied.lowest[1], std::max<int64_t>(tied.highest[0], 0),
              tied.highest[2], n);
  // The other stages hold other parameters: norms over the model add up over the group (a tied
  // one, held twice, counts half on each end).
  std::set<const void*> placed;
  for (nn::Module* chunk : chunks_)
    for (const Tensor& p : chunk->parameters()) {
      add_cut(p, {.kind = Cut::Kind::Stage, .group = group_, .count = end && is_tied(p) ? 2 : 0});
      placed.insert(p.impl());
    }
  for (DataParallelWrapper* wrapper : wrappers_)  // FSDP's shards: what its optimizer steps
    if (wrapper)
      for (const Tensor& t : wrapper->trained_parameters())
        if (placed.insert(t.impl()).second)
          add_cut(t, {.kind = Cut::Kind::Stage,
                      .group = group_,
                      .count = end && standing_in.contains(t.impl()) ? 2 : 0});
  if (tied.highest[0] > 0)
    tied_group_ =
        dist::split_group(group_, {{group_.global_rank(0), group_.global_rank(stages() - 1)}});
  else
    tied_.clear();  // a pipeline of one stage holds its only copy
}

void Pipeline::sum_tied_gradients() {
  if (tied_.empty() || tied_group_.rank() < 0) return;
  NoGradGuard no_grad;
  for (Tensor& p : tied_) {
    if (!p.grad().defined()) p.set_grad(zeros_like(p));
    dist::all_reduce(p.grad(), dist::ReduceOp::Sum, tied_group_);
  }
}

bool Pipeline::raise_if_any_stage_nonfinite(bool attached) {
  const std::vector<std::vector<int>> where =
      detail::ranks_where({!nonfinite_.empty(), attached}, group_);
  const std::vector<int>& stages = where[0];
  const std::string mine = std::exchange(nonfinite_, std::string());
  if (stages.empty()) return !where[1].empty();
  if (!mine.empty()) ::weave::detail::throw_error(mine);
  WEAVE_FAIL("Pipeline",
             "the averaged gradients of stage {} of pipeline group {} hold NaN or infinity (its "
             "data-parallel wrapper's check_finite), so every rank of every stage raises; hint: "
             "skip this step on every rank (zero_grad, no optimizer step), or lower the learning "
             "rate or loss scale",
             fmt::join(stages, ", "), group_.str());
}

}  // namespace weave::parallel

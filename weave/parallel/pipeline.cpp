// Pipeline schedules: the order of micro-batch forwards and backwards on each stage; the
// point-to-point traffic is dist::functional's remote_send / remote_recv.
#include "weave/parallel/pipeline.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/distributed/functional.h"

namespace weave::parallel {

namespace F = dist::functional;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::vector<Tensor> microbatches_of(const Tensor& batch, int m, const char* what) {
  WEAVE_CHECK(batch.defined() && batch.dim() >= 1, "Pipeline",
              "the {} needs a batch dimension, found {}", what,
              batch.defined() ? fmt::format("shape {}", batch.shape()) : "an undefined tensor");
  WEAVE_CHECK(batch.size(0) % m == 0, "Pipeline",
              "the {} has batch size {}, which does not divide into {} micro-batches; hint: "
              "choose microbatches dividing the batch size",
              what, batch.size(0), m);
  return chunk(batch, m, 0);
}

}  // namespace

Schedule schedule_from_name(const std::string& name) {
  if (name == "gpipe") return Schedule::GPipe;
  if (name == "1f1b") return Schedule::OneFOneB;
  WEAVE_FAIL("Pipeline", "unknown schedule '{}'; expected gpipe or 1f1b", name);
}

Pipeline::Pipeline(nn::Module& stage, PipelineOptions options)
    : stage_(stage), options_(options), group_(options.group ? *options.group : dist::world()) {
  WEAVE_CHECK(options.microbatches >= 1, "Pipeline", "microbatches must be at least 1, found {}",
              options.microbatches);
  WEAVE_CHECK(group_.rank() >= 0, "Pipeline",
              "rank {} is not in the pipeline group {}; hint: pass the mesh's pipeline group",
              dist::rank(), group_.str());
}

Tensor Pipeline::forward_microbatch(const Tensor& input, const Tensor& target,
                                    const PipelineLoss& loss) {
  Tensor x = input;
  if (!is_first()) {
    const double t = now_s();
    x = F::remote_recv(stage() - 1, group_);
    stats_.waiting_s += now_s() - t;
  }
  Tensor y = stage_(x);
  if (is_last()) return loss(y, target) / double(options_.microbatches);
  return F::remote_send(y, stage() + 1, group_);
}

void Pipeline::backward_microbatch(const Tensor& root) {
  const double before = F::receive_wait_seconds();
  autograd::backward({root}, {}, /*retain_graph=*/false, /*run_must_run_nodes=*/false);
  stats_.waiting_s += F::receive_wait_seconds() - before;
}

Tensor Pipeline::train_step(const Tensor& inputs, const Tensor& targets, const PipelineLoss& loss) {
  WEAVE_CHECK(autograd::must_run_pending() == 0, "Pipeline",
              "{} communicating autograd nodes from an earlier forward never ran backward, so "
              "peers may still wait for them; hint: finish that step's backward on every rank, "
              "or wrap forward-only passes in autograd::ForwardOnlyGuard",
              autograd::must_run_pending());
  const int m = options_.microbatches, p = stages(), s = stage();
  std::vector<Tensor> in, target;
  if (is_first()) in = microbatches_of(inputs, m, "input");
  if (is_last()) {
    WEAVE_CHECK(static_cast<bool>(loss), "Pipeline", "the last stage needs a loss function");
    target = microbatches_of(targets, m, "target");
  }
  stats_ = {};
  const double start = now_s();
  Tensor total;
  std::deque<Tensor> live;  // roots of the micro-batches whose backward is still to run
  int next_forward = 0;
  auto forward = [&] {
    const int i = next_forward++;
    Tensor root =
        forward_microbatch(is_first() ? in[i] : Tensor(), is_last() ? target[i] : Tensor(), loss);
    if (is_last()) {
      Tensor value = root.detach();
      total = total.defined() ? total + value : value;
    }
    live.push_back(root);
    stats_.peak_live_microbatches =
        std::max(stats_.peak_live_microbatches, static_cast<int>(live.size()));
  };
  auto backward = [&] {
    Tensor root = live.front();
    live.pop_front();
    backward_microbatch(root);
  };
  if (options_.schedule == Schedule::GPipe) {
    for (int i = 0; i < m; ++i) forward();
    for (int i = 0; i < m; ++i) backward();
  } else {
    const int warmup = std::min(p - s - 1, m);
    for (int i = 0; i < warmup; ++i) forward();
    for (int i = warmup; i < m; ++i) {
      forward();
      backward();
    }
    while (!live.empty()) backward();
  }
  {
    const double t = now_s();
    dist::wait_sends(group_);
    stats_.waiting_s += now_s() - t;
  }
  stats_.step_s = now_s() - start;
  return total;
}

Tensor Pipeline::predict(const Tensor& inputs) {
  NoGradGuard no_grad;
  const int m = options_.microbatches;
  std::vector<Tensor> in;
  if (is_first()) in = microbatches_of(inputs, m, "input");
  std::vector<Tensor> outputs;
  for (int i = 0; i < m; ++i) {
    Tensor x = is_first() ? in[i] : F::remote_recv(stage() - 1, group_);
    Tensor y = stage_(x);
    if (is_last())
      outputs.push_back(y);
    else
      F::remote_send(y, stage() + 1, group_);
  }
  dist::wait_sends(group_);
  return is_last() ? cat(outputs, 0) : Tensor();
}

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

}  // namespace weave::parallel

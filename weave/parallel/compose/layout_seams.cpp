#include "weave/parallel/compose/layout_seams.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>

#include "weave/autograd/grad_mode.h"
#include "weave/ops/ops.h"

namespace weave::parallel {

std::string LayoutReport::str() const {
  if (passed)
    return fmt::format(
        "layout passed: {} tensors, the loss and the norm equal one process's (largest relative "
        "difference {:.2g})",
        compared, largest_difference);
  return fmt::format("layout diverged at {}{}; likely seam: {}: {}", diverged,
                     difference > 0 ? fmt::format(" (relative difference {:.3g})", difference) : "",
                     seam, detail);
}

namespace detail {

namespace {

// Differences below this are rounding (float32's is 6e-8), not a seam: every mistake the check
// names moves the loss or a gradient by far more.
constexpr double kRoundingOnly = 1e-5;

// max |a - b| / max(max |a|, max |b|); 0 when both are zero.
double relative_difference(const Tensor& a, const Tensor& b) {
  NoGradGuard no_grad;
  if (a.shape() != b.shape()) return INFINITY;
  const Tensor x = a.to(kFloat64).to(kCPU), y = b.to(kFloat64).to(kCPU);
  const double scale = std::max(x.numel() ? x.abs().max().item<double>() : 0.0,
                                y.numel() ? y.abs().max().item<double>() : 0.0);
  if (scale == 0) return 0;
  const double difference = (x - y).abs().max().item<double>();
  return std::isnan(difference) ? INFINITY : difference / scale;
}

double scalar_difference(double a, double b) {
  const double scale = std::max(std::abs(a), std::abs(b));
  if (std::isnan(a) || std::isnan(b)) return INFINITY;
  return scale == 0 ? 0 : std::abs(a - b) / scale;
}

// A tensor of one side compared with the other's, by name in the reference's order.
struct Difference {
  std::string name;
  double value = 0;     // relative; INFINITY for a name one side lacks
  Tensor layout, mine;  // mine: one process's
};

std::vector<Difference> differences(const nn::NamedTensors& reference,
                                    const nn::NamedTensors& layout) {
  std::map<std::string, Tensor> held(layout.begin(), layout.end());
  std::vector<Difference> out;
  for (const auto& [name, t] : reference) {
    const auto it = held.find(name);
    out.push_back(it == held.end()
                      ? Difference{name, INFINITY, Tensor(), t}
                      : Difference{name, relative_difference(it->second, t), it->second, t});
    if (it != held.end()) held.erase(it);
  }
  for (const auto& [name, t] : held) out.push_back({name, INFINITY, t, Tensor()});
  return out;
}

const Difference* first_beyond(const std::vector<Difference>& all, double tolerance) {
  for (const Difference& d : all)
    if (d.value > tolerance) return &d;
  return nullptr;
}

// The r for which layout = r x one process for every differing gradient and the loss (when it
// differs), to 1e-8; none when no single factor explains them.
std::optional<double> common_ratio(const std::vector<Difference>& gradients, const LayoutFacts& f) {
  NoGradGuard no_grad;
  std::optional<double> ratio;
  auto agree = [&](double r) {
    if (!std::isfinite(r) || std::abs(r - 1) < 1e-8) return false;
    if (ratio && std::abs(r - *ratio) > 1e-8 * std::abs(*ratio)) return false;
    ratio = r;
    return true;
  };
  for (const Difference& d : gradients) {
    if (d.value <= f.tolerance) continue;
    if (!d.layout.defined() || !d.mine.defined()) return std::nullopt;
    const Tensor x = d.layout.to(kFloat64), y = d.mine.to(kFloat64);
    const double norm = (y * y).sum().item<double>();
    if (norm == 0 || !agree((x * y).sum().item<double>() / norm)) return std::nullopt;
    if (relative_difference(x, y * *ratio) > 1e-8) return std::nullopt;
  }
  if (scalar_difference(f.layout.loss, f.reference.loss) > f.tolerance &&
      (f.reference.loss == 0 || !agree(f.layout.loss / f.reference.loss)))
    return std::nullopt;
  return ratio;
}

// The signature of a load-balancing loss that differs: it depends on the routers' outputs
// alone, so a router's gradient differs (and, through the hidden states, everything before it,
// earlier experts included), while the experts of the last mixture, which only the main loss
// reaches, agree.
bool only_balancing_differs(const std::vector<Difference>& gradients, const LayoutFacts& f) {
  if (f.mixtures.empty()) return false;
  const std::string& last = f.mixtures.back();
  bool router = false, experts = false;
  for (const Difference& d : gradients) {
    const bool is_router = std::any_of(f.mixtures.begin(), f.mixtures.end(), [&](const auto& m) {
      return d.name.starts_with(m + "router.");
    });
    const bool last_expert = d.name.starts_with(last) && !is_router;
    experts = experts || last_expert;
    if (d.value <= f.tolerance) continue;
    if (last_expert) return false;
    router = router || is_router;
  }
  return router && experts;
}

// The seam of a step of the layout that raised.
std::string seam_of_step(const std::string& step, int context) {
  static const std::map<std::string, std::string> seams = {
      {"model", "model split"},   {"wrapper", "replicate group"}, {"sampler", "sampler group"},
      {"optimizer", "optimizer"}, {"loss", "loss normalization"}, {"backward", "replicate group"},
      {"clip", "clip group"},     {"optimizer step", "optimizer"}};
  if (step == "forward" || step == "pipeline step")
    return context > 1 ? "sequence layout" : "model split";
  const auto it = seams.find(step);
  return it == seams.end() ? "model split" : it->second;
}

void fail(LayoutReport& r, std::string diverged, double difference, std::string seam,
          std::string detail) {
  r.passed = false;
  r.diverged = std::move(diverged);
  r.difference = difference;
  r.seam = std::move(seam);
  r.detail = std::move(detail);
}

// The seam of a loss or gradients that differ while the inputs and the copies are right.
void diagnose_gradients(LayoutReport& r, const LayoutFacts& f,
                        const std::vector<Difference>& gradients, const Difference* gradient,
                        double loss_difference) {
  const bool loss_differs = loss_difference > f.tolerance;
  const std::string what = loss_differs ? "the loss" : "the gradient of " + gradient->name;
  const double difference = loss_differs ? loss_difference : gradient->value;
  if (const std::optional<double> ratio = common_ratio(gradients, f))
    return fail(r, what, difference, "loss normalization",
                fmt::format("the layout's loss and gradients are {:.6g} x one process's: the "
                            "loss is divided or summed once more than the mean over the batch; "
                            "hint: each rank's loss is the mean over its share (the data-parallel "
                            "wrapper averages over the data x context ranks)",
                            *ratio));
  if (only_balancing_differs(gradients, f))
    return fail(r, what, difference, "auxiliary loss",
                fmt::format("the routers' gradients differ, and what feeds them ({} first), "
                            "while the last mixture's experts' agree: a mixture of experts' "
                            "load-balancing loss is "
                            "skipped, or counted over this rank's tokens only; hint: attach it "
                            "(nn::MoE::with_aux_loss, as the library's blocks do) and balance "
                            "over the data x context ranks (ModelSplit::balance_group, "
                            "MoEOptions::reduce_shares)",
                            gradient ? gradient->name : "none"));
  if (loss_differs && f.context > 1)
    return fail(r, what, difference, "sequence layout",
                fmt::format("the loss is {:.17g} at the layout, {:.17g} on one process, while "
                            "the ranks' inputs cover the batch once: under context parallelism "
                            "each rank's part of every sequence must be cut as the attention "
                            "reads it; hint: ModelSplit::local_inputs, or parallel::"
                            "shard_sequence(x, 1, mesh.context(), layout) with the attention's "
                            "layout",
                            f.layout.loss, f.reference.loss));
  if (loss_differs)
    return fail(r, what, difference, "loss normalization",
                fmt::format("the loss is {:.17g} at the layout (the mean of the ranks' losses "
                            "over the data x context ranks), {:.17g} on one process; hint: each "
                            "rank's loss is the mean over its share, and the shares weigh alike "
                            "(a mean over this rank's counted tokens weighs ranks unequally when "
                            "they count different numbers)",
                            f.layout.loss, f.reference.loss));
  fail(r, what, difference, "replicate group",
       fmt::format("the loss agrees but the gradient of {} does not (not by a common factor): "
                   "gradients are averaged over other ranks than those that read the batch; "
                   "hint: DDP or FSDP over mesh.data_and_context() (parallel::data_parallel "
                   "picks it)",
                   gradient->name));
}

// What comes before the step's numbers: a step that raised, the parameters it starts from, the
// inputs. True when one of them diverged (r says which).
bool diagnose_setup(LayoutReport& r, const LayoutFacts& f, const std::vector<Difference>& initial) {
  if (!f.raised_step.empty()) {
    fail(r, "the " + f.raised_step + " (raised)", 0, seam_of_step(f.raised_step, f.context),
         f.raised_message);
  } else if (const Difference* d = first_beyond(initial, f.tolerance)) {
    if (!d->layout.defined() || !d->mine.defined())
      fail(r, "the parameter " + d->name, 0, "model split",
           fmt::format("{} holds it and {} does not: the model's parts must together hold the "
                       "whole model under the same names",
                       d->layout.defined() ? "the layout" : "one process",
                       d->layout.defined() ? "one process" : "the layout"));
    else
      fail(r, "the parameter " + d->name + " before the step", d->value, "initialization",
           "the layout starts from other values than one process: they were drawn outside the "
           "check's nn::DeferredInit (a tensor drawn at construction from a generator, or under a "
           "rank's own seed); hint: draw parameters by name (nn::init::normal_parameter, "
           "uniform_parameter) so that every layout holds one process's values");
  } else if (!f.inputs_problem.empty()) {
    fail(r, "the inputs", 0, "sampler group",
         f.inputs_problem +
             "; hint: give data rank d its block of rows (by mesh.data_rank(), or a "
             "DistributedSampler over mesh.data()), the same rows to its tensor and pipeline "
             "peers, and each context rank its part of those rows' sequences");
  }
  return !r.passed;
}

// The loss and the gradients: copies that differ, float32's rounding, then the gradient seams.
// True when one of them diverged.
bool diagnose_backward(LayoutReport& r, const LayoutFacts& f,
                       const std::vector<Difference>& gradients, double loss_difference) {
  const Difference* gradient = first_beyond(gradients, f.tolerance);
  if (!f.differing_copies.empty()) {
    fail(r,
         gradient ? "the gradient of " + gradient->name
                  : "the gradient of " + f.differing_copies + " (its copies differ)",
         gradient ? gradient->value : 0, "replicate group",
         fmt::format("the ranks holding copies of {} hold different gradients ({}): it is "
                     "averaged over other ranks than all that read the batch; hint: DDP or FSDP "
                     "over mesh.data_and_context(), HSDP with replicate_group = mesh.replicate() "
                     "(parallel::data_parallel wires both)",
                     f.differing_copies, f.copy_sides));
    return true;
  }
  if (loss_difference <= f.tolerance && !gradient) return false;
  const double difference = std::max(loss_difference, gradient ? gradient->value : 0.0);
  if (difference >= kRoundingOnly) {
    diagnose_gradients(r, f, gradients, gradient, loss_difference);
    return true;
  }
  fail(r, loss_difference > f.tolerance ? "the loss" : "the gradient of " + gradient->name,
       difference, "precision",
       fmt::format("the layout agrees with one process to {:.2g} but not to {:.2g}, as a step "
                   "rounded to float32 does: a mixed-precision policy (FSDP's reduce_dtype or "
                   "output_dtype, param_dtype, autocast) or a float32 tensor in the model; hint: "
                   "check the layout in float64 throughout, with the policy off",
                   difference, f.tolerance));
  return true;
}

// The norm and the step, once the gradients agree (or were not compared).
void diagnose_step(LayoutReport& r, const LayoutFacts& f, const std::vector<Difference>& after,
                   double norm_difference, int norm_rank) {
  const std::string norms = fmt::format(
      "rank {}'s {:.17g}, one process's {:.17g}", norm_rank,
      f.layout_norms.empty() ? 0.0 : f.layout_norms[size_t(norm_rank)], f.reference.norm);
  if (norm_difference > f.tolerance && !f.have_gradients)
    fail(r, "the norm", norm_difference, "replicate group",
         fmt::format("the norm returned by the optimizer's own step (which averages and clips) "
                     "differs ({}): it averaged the gradients over other ranks than those that "
                     "read the batch; hint: ZeroRedundancyOptimizer or DistributedOptimizer over "
                     "mesh.data_and_context()",
                     norms));
  else if (norm_difference > f.tolerance)
    fail(r, "the norm", norm_difference, "clip group",
         fmt::format("the gradients agree, the norm does not ({}): it was taken over ranks that "
                     "do not hold the whole model once; hint: parallel::clip_grad_norm_(wrapper's "
                     "trained_parameters(), max_norm) over the world (each parameter's placement "
                     "counts its pieces once)",
                     norms));
  else if (const Difference* d = first_beyond(after, f.tolerance))
    fail(r, "the parameter " + d->name + " after the step", d->value, "optimizer",
         "the gradients and the norm agree, the step does not: the optimizer's parameters, "
         "groups or options differ from one process's; hint: "
         "optim::AdamW(wrapper->param_groups(optim::weight_decay_groups(model, wd)), ...)");
}

}  // namespace

LayoutReport diagnose(const LayoutFacts& f) {
  LayoutReport r;
  r.passed = true;
  const auto compared = [](bool taken, const nn::NamedTensors& mine, const nn::NamedTensors& held) {
    return taken ? differences(mine, held) : std::vector<Difference>();
  };
  const std::vector<Difference> initial =
      compared(f.have_initial, f.reference.initial, f.layout.initial);
  const std::vector<Difference> gradients =
      compared(f.have_gradients, f.reference.gradients, f.layout.gradients);
  const std::vector<Difference> after = compared(f.have_after, f.reference.after, f.layout.after);
  for (const auto* all : {&initial, &gradients, &after})
    for (const Difference& d : *all) {
      r.largest_difference = std::max(r.largest_difference, d.value);
      ++r.compared;
    }
  const double loss_difference =
      f.have_loss ? scalar_difference(f.layout.loss, f.reference.loss) : 0;
  double norm_difference = 0;
  int norm_rank = 0;
  for (size_t k = 0; k < f.layout_norms.size(); ++k)
    if (const double d = scalar_difference(f.layout_norms[k], f.reference.norm);
        d > norm_difference)
      norm_difference = d, norm_rank = int(k);
  r.largest_difference = std::max({r.largest_difference, loss_difference, norm_difference});
  if (!diagnose_setup(r, f, initial) && !diagnose_backward(r, f, gradients, loss_difference))
    diagnose_step(r, f, after, norm_difference, norm_rank);
  return r;
}

}  // namespace detail

}  // namespace weave::parallel

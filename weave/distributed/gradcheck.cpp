#include "weave/distributed/gradcheck.h"

#include <cmath>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/ops/ops.h"

namespace weave::dist {

namespace {

double all_sum(double v, const Group& g) {
  Tensor t = full({1}, v, {.dtype = kFloat64});
  all_reduce(t, ReduceOp::Sum, g);
  return t.item<double>();
}

}  // namespace

namespace {

using Function = std::function<Tensor(const std::vector<Tensor>&)>;

// Every rank checks float64 leaves, as many as every other rank (both bounds of the count
// travel, so every rank raises on a mismatch, not only the ranks below the largest count), and
// some rank has an element to check.
void check_inputs(const std::vector<Tensor>& inputs, const Group& group) {
  WEAVE_CHECK(group.rank() >= 0, "gradcheck", "this rank is not in group {}", group.str());
  int64_t checkable = 0;
  for (size_t i = 0; i < inputs.size(); ++i)
    if (inputs[i].defined() && inputs[i].requires_grad()) {
      WEAVE_CHECK(inputs[i].dtype() == kFloat64 && inputs[i].is_leaf(), "gradcheck",
                  "input {} must be a float64 leaf, found {}", i, inputs[i].dtype());
      checkable += inputs[i].numel();
    }
  const int64_t mine = int64_t(inputs.size());
  const std::vector<int64_t> bounds = agree_max({mine, -mine, checkable > 0 ? 1 : 0}, group);
  WEAVE_CHECK(bounds[0] == -bounds[1], "gradcheck",
              "ranks pass different numbers of inputs (from {} to {}; this rank {})", -bounds[1],
              bounds[0], mine);
  WEAVE_CHECK(bounds[2] == 1, "gradcheck",
              "nothing to check: no rank of group {} has an input that requires grad with any "
              "element, so no gradient would be compared; hint: x.requires_grad_() on the inputs "
              "whose gradient to check",
              group.str());
}

// The rank's largest error over the elements it owns, and its description.
struct Worst {
  double error = -1;
  std::string report;
  int64_t checked = 0;
};

// Numeric: the elements of rank r's checked inputs, one at a time, on every rank (each rank's
// loss is its output against its own random probe; their sum is the function checked).
Worst compare_numeric(const std::function<Tensor(const std::vector<Tensor>&)>& local_loss,
                      const std::vector<Tensor>& inputs, const autograd::GradcheckOptions& options,
                      const Group& group) {
  const int me = group.rank(), n = group.size();
  std::vector<int64_t> sizes;
  for (const Tensor& x : inputs) sizes.push_back(x.defined() && x.requires_grad() ? x.numel() : 0);
  Tensor all_sizes = empty({int64_t(n * sizes.size())}, {.dtype = kInt64});
  all_gather(all_sizes, from_vector(sizes), group);
  const auto table = all_sizes.to_vector<int64_t>();
  Worst worst;
  for (int r = 0; r < n; ++r)
    for (size_t k = 0; k < inputs.size(); ++k)
      for (int64_t e = 0; e < table[r * inputs.size() + k]; ++e) {
        NoGradGuard no_grad;
        const bool mine = r == me;
        Tensor cell = mine ? element_view(inputs[k], e) : Tensor();
        const double original = mine ? cell.item<double>() : 0;
        if (mine) cell.fill_(original + options.eps);
        const double plus = all_sum(local_loss(inputs).item<double>(), group);
        if (mine) cell.fill_(original - options.eps);
        const double minus = all_sum(local_loss(inputs).item<double>(), group);
        if (!mine) continue;
        cell.fill_(original);
        const double numeric = (plus - minus) / (2 * options.eps);
        Tensor g = inputs[k].grad();
        const double analytic = g.defined() ? element_view(g, e).item<double>() : 0.0;
        double error = std::fabs(analytic - numeric) - options.rtol * std::fabs(numeric);
        if (std::isnan(error)) error = INFINITY;
        ++worst.checked;
        if (error <= worst.error) continue;
        worst.error = error;
        worst.report = fmt::format(
            "rank {} input {} (shape {}) element {}: analytic {:.8g} vs numeric {:.8g} (error "
            "{:.3g}, allowed {:.3g})",
            group.global_rank(me), k, inputs[k].shape(), e, analytic, numeric,
            std::fabs(analytic - numeric), options.atol + options.rtol * std::fabs(numeric));
      }
  return worst;
}

// Agrees on the verdict and shares the worst report.
DistGradcheckResult agree_on_result(const Worst& worst, const autograd::GradcheckOptions& options,
                                    const Group& group) {
  DistGradcheckResult result;
  Tensor errors = empty({group.size()}, {.dtype = kFloat64});
  all_gather(errors, full({1}, worst.error, {.dtype = kFloat64}), group);
  auto all_errors = errors.to_vector<double>();
  result.worst_rank =
      int(std::max_element(all_errors.begin(), all_errors.end()) - all_errors.begin());
  result.max_error = std::max(0.0, all_errors[result.worst_rank]);
  result.ok = all_errors[result.worst_rank] <= options.atol;
  result.checked = int64_t(all_sum(double(worst.checked), group));
  std::vector<uint8_t> bytes(worst.report.begin(), worst.report.end());
  Tensor length = full({1}, double(bytes.size()), {.dtype = kInt64});
  broadcast(length, result.worst_rank, group);
  Tensor text = group.rank() == result.worst_rank
                    ? (bytes.empty() ? empty({0}, {.dtype = kUInt8}) : from_vector(bytes))
                    : empty({length.item<int64_t>()}, {.dtype = kUInt8});
  if (length.item<int64_t>() > 0) broadcast(text, result.worst_rank, group);
  auto chars = text.to_vector<uint8_t>();
  result.report = std::string(chars.begin(), chars.end());
  return result;
}

}  // namespace

DistGradcheckResult gradcheck(const Function& fn, const std::vector<Tensor>& inputs,
                              autograd::GradcheckOptions options, const Group& group) {
  check_inputs(inputs, group);
  Tensor probe;  // V_r
  auto local_loss = [&](const std::vector<Tensor>& xs) {
    Tensor y = fn(xs);
    WEAVE_CHECK(y.defined(), "gradcheck", "the function returned an undefined tensor");
    if (!probe.defined()) {
      Generator generator(options.seed * 7919 + uint64_t(group.global_rank(group.rank())) + 1);
      probe = randn(y.shape(), {.dtype = kFloat64}, &generator).to(y.device());
    }
    return y.numel() == 0 ? zeros({}, {.dtype = kFloat64}) : sum(y.to(kFloat64) * probe);
  };
  // Analytic: each rank backpropagates its own loss; collectives carry the rest.
  for (const Tensor& x : inputs)
    if (x.defined() && x.requires_grad()) x.set_grad({});
  Tensor l = local_loss(inputs);
  autograd::backward(l.requires_grad() ? std::vector<Tensor>{l} : std::vector<Tensor>{});
  return agree_on_result(compare_numeric(local_loss, inputs, options, group), options, group);
}

}  // namespace weave::dist

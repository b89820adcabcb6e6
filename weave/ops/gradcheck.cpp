#include "weave/ops/gradcheck.h"

#include <cmath>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/ops/ops.h"

namespace weave::autograd {

GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                          const std::vector<Tensor>& inputs, GradcheckOptions options) {
  int64_t checkable = 0;
  for (size_t i = 0; i < inputs.size(); ++i)
    if (inputs[i].defined() && inputs[i].requires_grad()) {
      WEAVE_CHECK(inputs[i].dtype() == kFloat64 && inputs[i].is_leaf(), "gradcheck",
                  "input {} must be a float64 leaf, found {} {}; hint: "
                  "x.to(kFloat64).detach().requires_grad_()",
                  i, inputs[i].dtype(), inputs[i].is_leaf() ? "leaf" : "non-leaf");
      checkable += inputs[i].numel();
    }
  WEAVE_CHECK(checkable > 0, "gradcheck",
              "nothing to check: none of the {} inputs requires grad with any element, so no "
              "gradient would be compared; hint: x.requires_grad_() on the inputs whose gradient "
              "to check",
              inputs.size());

  Tensor probe;  // the fixed projection V
  auto loss = [&](const std::vector<Tensor>& xs) {
    Tensor y = fn(xs);
    WEAVE_CHECK(y.defined(), "gradcheck", "the function returned an undefined tensor");
    if (!probe.defined()) {
      Generator generator(options.seed);
      probe = randn(y.shape(), {.dtype = kFloat64}, &generator).to(y.device());
    }
    return sum(y.to(kFloat64) * probe);
  };

  for (const Tensor& x : inputs)
    if (x.defined() && x.requires_grad()) x.set_grad({});
  Tensor l = loss(inputs);
  GradcheckResult result;
  if (l.requires_grad()) backward({l});

  double worst = -1;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& x = inputs[i];
    if (!x.defined() || !x.requires_grad()) continue;
    Tensor analytic = x.grad().defined() ? x.grad().contiguous() : zeros_like(x);
    std::vector<double> a = analytic.to_vector<double>();
    for (int64_t e = 0; e < x.numel(); ++e) {
      NoGradGuard no_grad;
      Tensor element = element_view(x, e);  // shares storage: perturb in place
      const double original = element.item<double>();
      element.fill_(original + options.eps);
      double plus = loss(inputs).item<double>();
      element.fill_(original - options.eps);
      double minus = loss(inputs).item<double>();
      element.fill_(original);
      double numeric = (plus - minus) / (2 * options.eps);
      double error = std::fabs(a[e] - numeric) - options.rtol * std::fabs(numeric);
      ++result.checked;
      if (!(error <= options.atol)) result.ok = false;  // NaN fails too
      if (std::isnan(error) || error > worst) {
        worst = std::isnan(error) ? INFINITY : error;
        result.max_error = worst;
        if (!result.ok || error > options.atol)
          result.report = fmt::format(
              "input {} (shape {}) element {}: analytic {:.8g} vs numeric {:.8g} (error {:.3g}, "
              "allowed {:.3g})",
              i, x.shape(), e, a[e], numeric, std::fabs(a[e] - numeric),
              options.atol + options.rtol * std::fabs(numeric));
      }
    }
  }
  return result;
}

}  // namespace weave::autograd

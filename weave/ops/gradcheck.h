#pragma once
// Numerical gradient checking against finite differences.
#include <functional>
#include <string>
#include <vector>

#include "weave/tensor/tensor.h"

namespace weave::autograd {

struct GradcheckOptions {
  double eps = 1e-6;   // central-difference step
  double atol = 1e-5;  // pass if |analytic - numeric| <= atol + rtol * |numeric|
  double rtol = 1e-3;
  uint64_t seed = 0;  // seeds the random projection of the output
};

struct GradcheckResult {
  bool ok = true;
  double max_error = 0;  // largest |analytic - numeric| - rtol * |numeric| seen
  int64_t checked = 0;   // input elements compared
  /// On failure: the input, element, analytic and numeric values of the worst element.
  std::string report;
};

/// Checks the gradient of fn at inputs. Only the inputs that require grad are checked (each a
/// float64 leaf); the others are passed to fn as they are. Raises when no input requiring grad
/// has an element, because the check would then compare nothing (a backward that is wrong, or
/// missing, would pass). The output is reduced to L = sum(fn(inputs) * V) with a fixed random
/// V, so one backward gives dL/dx, which is compared with (L(x + eps) - L(x - eps)) / 2 eps
/// element by element.
GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                          const std::vector<Tensor>& inputs, GradcheckOptions options = {});

}  // namespace weave::autograd

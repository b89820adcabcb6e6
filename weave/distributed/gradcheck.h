#pragma once
// Gradient checking for functions that communicate.
#include <functional>
#include <vector>

#include "weave/distributed/distributed.h"
#include "weave/ops/gradcheck.h"

namespace weave::dist {

struct DistGradcheckResult {
  bool ok = true;        // the same on every rank
  double max_error = 0;  // worst |analytic - numeric| - rtol * |numeric| over all ranks
  int64_t checked = 0;   // elements compared, all ranks together
  int worst_rank = -1;   // group rank holding the worst element
  std::string report;    // the worst element (rank, input, element, values), on every rank
};

/// Checks fn against finite differences under the sum-of-losses convention. Every rank of the
/// group calls it with its own inputs (the same number of inputs on every rank); only those
/// that require grad are checked (each a float64 leaf), the others are passed as they are. A
/// rank may check none, but when no rank has an input requiring grad with an element, every rank
/// raises: the check would compare nothing, and a wrong backward would pass. The
/// loss is L = sum_r sum(fn_r(inputs_r) * V_r) with a fixed random V_r per rank; one backward
/// on every rank gives dL/dx. Then, for each rank r and each element i of r's inputs, all ranks
/// evaluate L with that element moved by +-eps and rank r compares the central difference with
/// its analytic gradient.
DistGradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                              const std::vector<Tensor>& inputs,
                              autograd::GradcheckOptions options = {},
                              const Group& group = world());

}  // namespace weave::dist

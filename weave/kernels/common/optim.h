#pragma once
// An optimizer step's constants in the compute type, from the step both backends receive
// (C++17 and host/device: nvcc compiles it, and kernels compute them per tensor).
#include "weave/kernels/functors.h"
#include "weave/kernels/kernels.h"

namespace weave::kernels::common {

template <class T>
auto sgd_constants(const SgdStep& step) {
  return functors::sgd_constants<T>(step.lr, step.momentum, step.dampening, step.weight_decay,
                                    step.nesterov, step.first);
}

/// `weight_decay`: the tensor's own (multi-tensor steps carry one per tensor).
template <class T>
WEAVE_HD auto adam_constants(const AdamStep& step, double weight_decay) {
  return functors::adam_constants<T>(step.lr, step.beta1, step.beta2, step.eps, weight_decay,
                                     step.correction1, step.correction2, step.decoupled);
}
template <class T>
WEAVE_HD auto adam_constants(const AdamStep& step) {
  return adam_constants<T>(step, step.weight_decay);
}

}  // namespace weave::kernels::common

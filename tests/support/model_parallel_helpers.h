#pragma once
// What the model-parallel suites (tensor-parallel layers, pipelines) share: float64 values
// built alike on every rank and compared tightly.
#include <doctest/doctest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "weave/weave.h"

namespace weave_test {

using namespace weave;

inline bool close(const Tensor& got, const Tensor& expected, double rtol = 1e-10) {
  return got.defined() && got.shape() == expected.shape() && allclose(got, expected, rtol, 1e-13);
}

// This rank's slice along axis of a tensor split over the group.
inline Tensor piece(const Tensor& full, int axis, const dist::Group& g) {
  const int64_t n = full.size(axis) / g.size();
  return full.narrow(axis, g.rank() * n, n);
}

// The same values on every rank.
inline Tensor shared_randn(const Shape& shape, uint64_t seed) {
  Generator g(seed);
  return randn(shape, {.dtype = kFloat64}, &g);
}

inline Tensor leaf(const Tensor& t) {
  return t.detach().contiguous().clone().requires_grad_(true);
}

inline Tensor mse(const Tensor& out, const Tensor& target) {
  return mse_loss(out, target);
}

// Checks that every parameter of `split` (this rank's slices of `whole`'s, under the same names)
// has the gradient expected(name, whole's gradient), to rtol; returns the names compared.
inline std::vector<std::string> check_split_grads(
    nn::Module& split, nn::Module& whole,
    const std::function<Tensor(const std::string&, const Tensor&)>& expected, double rtol) {
  const auto theirs = whole.named_parameters();
  std::vector<std::string> compared;
  for (const auto& [name, p] : split.named_parameters()) {
    const std::string label = name;  // a copy: CAPTURE's lambda cannot take a binding
    CAPTURE(label);
    const auto it =
        std::find_if(theirs.begin(), theirs.end(), [&](const auto& e) { return e.first == label; });
    REQUIRE(it != theirs.end());
    CHECK(close(p.grad(), expected(label, it->second.grad()), rtol));
    compared.push_back(label);
  }
  return compared;
}

}  // namespace weave_test

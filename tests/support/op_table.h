#pragma once
// The op table's cases (tests/test_op_table.cpp), shared with the suite that compares them on
// CUDA against the CPU (tests/test_op_table_cuda.cpp).
#include <functional>
#include <string>
#include <vector>

#include "weave/weave.h"

namespace weave::test {

using Inputs = std::vector<Tensor>;

enum class Domain { Any, Positive, Unit };

struct Input {
  Shape shape;
  Domain domain = Domain::Any;
  bool transposed = false;  // a non-contiguous leaf (transposed storage) of this shape
};

struct OpCase {
  std::string op;
  std::vector<Input> inputs;
  std::function<Tensor(const Inputs&)> fn;
  double eps = 1e-6;  // finite-difference step (larger where the op rounds to float32)
};

/// Every case of the table, in a fixed order.
std::vector<OpCase> op_cases();
/// Float64 leaves that require grad, drawn from `generator` for `specs`.
std::vector<Tensor> make_inputs(const std::vector<Input>& specs, Generator& generator);

}  // namespace weave::test

#pragma once
// What a model holds, as PyTorch users read it from torchinfo's summary or a parameter count.
//
//   std::printf("%s", nn::summary(model).c_str());
//   //  Llama                           parameters
//   //  ├─ embedding  Embedding              4,096
//   //  ├─ blocks     Sequential            66,048
//   //  │  ├─ 0      LlamaBlock            33,024
//   //  ...
//   //  total 74,368 parameters (74.4 K), 74,368 trainable, 0 frozen, 297.5 KB
//
// Under model parallelism the counts are this rank's pieces (its slices, experts, stage).
#include <cstdint>
#include <string>

#include "weave/nn/module.h"

namespace weave::nn {

struct ParameterCount {
  int64_t total = 0;      // elements of every parameter (a tied weight once)
  int64_t trainable = 0;  // those that require grad
  int64_t bytes = 0;      // their storage, in their dtypes
};
ParameterCount count_parameters(const Module& model);

/// The model's modules to `depth` levels below it (each with its type and its parameters'
/// count), then the totals, one line each.
std::string summary(const Module& model, int depth = 2);

}  // namespace weave::nn

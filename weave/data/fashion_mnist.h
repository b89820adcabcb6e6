#pragma once
// Fashion-MNIST (Xiao et al. 2017) from the gzipped IDX files that Debian's
// dataset-fashion-mnist package installs.
#include <string>

#include "weave/ops/ops.h"

namespace weave::data {

inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

struct MnistSplit {
  Tensor images;  // uint8 [N, 28, 28]
  Tensor labels;  // int64 [N]
};

/// Loads the train (60000) or test (10000) split from dir. A missing, truncated or corrupt
/// file raises weave::Error naming the file.
MnistSplit load_fashion_mnist(const std::string& dir = kFashionMnistDir, bool train = true);

/// Reads one IDX file (gzipped or plain) into a uint8 tensor shaped by its header.
Tensor read_idx(const std::string& path);

}  // namespace weave::data

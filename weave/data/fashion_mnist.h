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

/// Reads one IDX file (gzipped or plain) into a uint8 tensor shaped by its header. A file that
/// is truncated, has another magic or dtype, declares implausible sizes, or holds more or less
/// data than its header says raises weave::Error naming the file.
Tensor read_idx(const std::string& path);
/// The same for an uncompressed IDX image in memory; `name` names it in errors.
Tensor read_idx_bytes(const void* data, size_t size, const std::string& name = "IDX data");

}  // namespace weave::data

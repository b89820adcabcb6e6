// libFuzzer target: any bytes given to the IDX reader give a tensor or a weave::Error, never a
// crash, a sanitizer report or a huge allocation.
#include <cstddef>
#include <cstdint>

#include "weave/data/fashion_mnist.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    weave::Tensor t = weave::data::read_idx_bytes(data, size, "fuzz input");
    if (t.numel() > 0) (void)t.data<uint8_t>()[t.numel() - 1];  // the last byte is readable
  } catch (const weave::Error&) {
  }
  return 0;
}

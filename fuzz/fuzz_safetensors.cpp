// libFuzzer target: any bytes given to the safetensors parser give tensors or a weave::Error,
// never a crash or a sanitizer report. Whatever parses must serialize and parse back the same.
#include <cstddef>
#include <cstdint>

#include "weave/data/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace weave;
  try {
    const data::SafetensorsFile file = data::parse_safetensors(data, size, "fuzz input");
    const std::string again = data::serialize_safetensors(file.tensors, file.metadata);
    const data::SafetensorsFile back = data::parse_safetensors(again.data(), again.size(), "again");
    if (back.tensors.size() != file.tensors.size() || back.metadata != file.metadata)
      __builtin_trap();
    for (size_t i = 0; i < file.tensors.size(); ++i)
      if (back.tensors[i].first != file.tensors[i].first ||
          back.tensors[i].second.shape() != file.tensors[i].second.shape())
        __builtin_trap();
  } catch (const weave::Error&) {
  }
  return 0;
}

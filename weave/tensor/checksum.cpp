#include "weave/tensor/checksum.h"

#include <zlib.h>

namespace weave {

uint32_t checksum_bytes(const void* data, size_t size) {
  return static_cast<uint32_t>(::crc32_z(0, static_cast<const Bytef*>(data), size));
}

uint32_t checksum(const Tensor& t) {
  const Tensor host = t.detach().cpu().contiguous();
  return checksum_bytes(host.data_ptr(), size_t(host.numel()) * host.itemsize());
}

}  // namespace weave

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

uint64_t checksum64(const Tensor& t) {
  const Tensor host = t.detach().cpu().contiguous();
  const auto* bytes = static_cast<const Bytef*>(host.data_ptr());
  const size_t size = size_t(host.numel()) * host.itemsize();
  return uint64_t(::crc32_z(0, bytes, size)) << 32 | uint64_t(::adler32_z(1, bytes, size));
}

}  // namespace weave

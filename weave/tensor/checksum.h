#pragma once
// CRC-32 checksums (zlib's polynomial), for whatever must tell whether bytes changed: a file's
// contents (checkpoints), or whether ranks hold the same parameter values.
#include <cstddef>
#include <cstdint>

#include "weave/tensor/tensor.h"

namespace weave {

/// CRC-32 of `size` bytes.
uint32_t checksum_bytes(const void* data, size_t size);
/// CRC-32 of a tensor's values as stored: its elements' bytes in row-major order, wherever the
/// tensor lives (a CUDA tensor is copied to the host first).
uint32_t checksum(const Tensor& t);
/// 64 bits of a tensor's values (CRC-32 and Adler-32 side by side), where a collision would go
/// unnoticed: replicas that skip a broadcast because their values agree.
uint64_t checksum64(const Tensor& t);

}  // namespace weave

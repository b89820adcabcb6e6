#pragma once
// Large reduce-scatters and all-gathers in chunks (internal to the MPI backend). Open MPI's
// algorithms for them allocate scratch as large as the whole buffer on some ranks (a 206 MB
// unit's reduce-scatter held 390 MB more resident on rank 0 than on the others), memory that
// no tensor accounts for. Sent in calls of at most `chunk_bytes` over all ranks, each on a
// packed copy of that chunk, MPI's scratch and the copy scale with the chunk instead
// (WEAVE_MPI_CHUNK_MB, docs/memory.md).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace weave::dist::detail {

/// Elements a rank per call: chunk_bytes over every rank's share, at least 1; 0: not chunked.
inline int64_t chunk_elements(int64_t chunk_bytes, int ranks, int64_t item) {
  if (chunk_bytes <= 0) return 0;
  return std::max<int64_t>(1, chunk_bytes / (int64_t(ranks) * item));
}

/// reduce_scatter(in [ranks x count], out [count]) as call(send, recv, m) on chunks of m
/// elements a rank: each chunk's blocks packed (block r of in, elements [at, at + m)).
template <class Call>
void reduce_scatter_in_chunks(const char* in, char* out, int64_t count, int ranks, int64_t item,
                              int64_t chunk, const Call& call) {
  if (chunk <= 0 || count <= chunk) return call(in, out, count);
  std::vector<char> packed(size_t(int64_t(ranks) * chunk * item));
  for (int64_t at = 0; at < count; at += chunk) {
    const int64_t m = std::min(chunk, count - at);
    for (int r = 0; r < ranks; ++r)
      std::memcpy(packed.data() + r * m * item, in + (r * count + at) * item, size_t(m * item));
    call(packed.data(), out + at * item, m);
  }
}

/// all_gather(in [count], out [ranks x count]) as call(send, recv, m) on chunks of m elements a
/// rank, each gathered packed, then unpacked into every rank's block (in may be this rank's own
/// block of out: a chunk unpacks the values it sent).
template <class Call>
void all_gather_in_chunks(const char* in, char* out, int64_t count, int ranks, int64_t item,
                          int64_t chunk, const Call& call) {
  if (chunk <= 0 || count <= chunk) return call(in, out, count);
  std::vector<char> packed(size_t(int64_t(ranks) * chunk * item));
  for (int64_t at = 0; at < count; at += chunk) {
    const int64_t m = std::min(chunk, count - at);
    call(in + at * item, packed.data(), m);
    for (int r = 0; r < ranks; ++r)
      std::memcpy(out + (r * count + at) * item, packed.data() + r * m * item, size_t(m * item));
  }
}

}  // namespace weave::dist::detail

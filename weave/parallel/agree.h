#pragma once
// What the ranks of a group must hold alike before they train together (the same model, the
// same parameter list, the same options), checked collectively: every rank raises, naming the
// first difference, or none does.
#include <string>
#include <vector>

#include "weave/distributed/distributed.h"

namespace weave::parallel::detail {

/// Raises weave::Error on every rank of the group unless every rank holds the same `lines`:
/// "[op] ranks disagree on <what>: entry 3 is '...' on rank 0 but '...' on rank 2; hint: <hint>".
/// Collective.
void check_same_lines(const std::vector<std::string>& lines, const dist::Group& group,
                      const char* op, const std::string& what, const std::string& hint);

/// "parameter 3 float32 [4, 5]" for each tensor.
std::vector<std::string> describe_tensors(const std::vector<Tensor>& tensors);
/// "parameter 3 crc32 1a2b3c4d": each tensor's values, as a checksum of its bytes.
std::vector<std::string> describe_values(const std::vector<Tensor>& tensors);

}  // namespace weave::parallel::detail

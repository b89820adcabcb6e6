#pragma once
// What the ranks of a group must hold alike before they train together (the same model, the
// same parameter list, the same options), checked collectively: every rank raises, naming the
// first difference, or none does.
#include <functional>
#include <string>
#include <vector>

#include "weave/distributed/distributed.h"

namespace weave::nn {
class Module;
}

namespace weave::parallel::detail {

/// Raises weave::Error on every rank of the group unless every rank holds the same `lines`:
/// "[op] ranks disagree on <what>: entry 3 is '...' on rank 0 but '...' on rank 2; hint: <hint>".
/// Collective.
void check_same_lines(const std::vector<std::string>& lines, const dist::Group& group,
                      const char* op, const std::string& what, const std::string& hint);

/// Raises weave::Error (tagged `op`) on every rank of the group, naming the first difference,
/// unless every rank's module has the same parameter and buffer names, shapes and dtypes.
/// Collective.
void check_same_model(const nn::Module& module, const dist::Group& group, const char* op);

/// Runs this rank's argument `checks`, then agrees on the outcome over the group before anything
/// else is communicated: a rank whose checks raised re-raises its error, and every other rank
/// raises too ("a rank of group ... rejected its arguments"), so none waits for a peer that
/// gave up. `values` travel in the same all_reduce (elementwise max; pass -x for a minimum),
/// and their maxima are returned. Collective: one all_reduce.
std::vector<int64_t> check_together(const std::function<void()>& checks, const dist::Group& group,
                                    const char* op, std::vector<int64_t> values = {});

/// "parameter 3 float32 [4, 5]" for each tensor.
std::vector<std::string> describe_tensors(const std::vector<Tensor>& tensors);
/// "parameter 3 crc32 1a2b3c4d": each tensor's values, as a checksum of its bytes.
std::vector<std::string> describe_values(const std::vector<Tensor>& tensors);

}  // namespace weave::parallel::detail

// Ready-order agreement and bucket cutting.
#include "weave/parallel/buckets.h"

#include <algorithm>

#include "weave/ops/ops.h"

namespace weave::parallel::detail {

std::vector<int> agree_on_order(std::vector<int> trace, size_t parameters, const dist::Group& group,
                                bool& differs_anywhere, std::vector<int64_t>* counts) {
  for (int i = int(parameters) - 1; i >= 0; --i)
    if (std::find(trace.begin(), trace.end(), i) == trace.end()) trace.push_back(i);
  std::vector<int64_t> mine(trace.begin(), trace.end());
  Tensor first = from_vector(mine);
  dist::broadcast(first, 0, group);
  const std::vector<int64_t> adopted = first.to_vector<int64_t>();
  std::vector<int64_t> words = {adopted != mine ? 1 : 0};
  if (counts) words.insert(words.end(), counts->begin(), counts->end());
  Tensor summed = from_vector(words);
  dist::all_reduce(summed, dist::ReduceOp::Sum, group);
  words = summed.to_vector<int64_t>();
  differs_anywhere = words[0] != 0;
  if (counts) counts->assign(words.begin() + 1, words.end());
  return {adopted.begin(), adopted.end()};
}

std::vector<std::vector<int>> cut_buckets(const std::vector<int>& order,
                                          const std::vector<Tensor>& params, double first_mb,
                                          double mb) {
  std::vector<std::vector<int>> buckets;
  double bytes = 0;
  for (int i : order) {
    const Tensor& p = params[i];
    const double size = double(p.numel()) * double(p.itemsize());
    const double cap = (buckets.size() <= 1 ? first_mb : mb) * 1024.0 * 1024.0;
    bool fresh = buckets.empty();
    if (!fresh) {
      const Tensor& first = params[buckets.back().front()];
      fresh = first.dtype() != p.dtype() || first.device() != p.device() || bytes + size > cap;
    }
    if (fresh) {
      buckets.emplace_back();
      bytes = 0;
    }
    buckets.back().push_back(i);
    bytes += size;
  }
  return buckets;
}

}  // namespace weave::parallel::detail

// The agreement primitive: rounds on the board, or an all_reduce of the host communicator; and
// dist::agree_max, the collective call every agreement above distributed/ goes through.
#include "weave/distributed/agreement.h"

#include <algorithm>

#include "weave/autograd/engine.h"
#include "weave/distributed/runtime.h"
#include "weave/tensor/storage.h"

namespace weave::dist {

namespace detail {

void max_round(Communicator& host, AgreementBoard* board, std::span<int64_t, kRoundWords> round) {
  if (board != nullptr)
    board->max(round);
  else
    host.all_reduce(round.data(), round.data(), int64_t(kRoundWords), kInt64, ReduceOp::Max);
}

void max_words(Communicator& host, AgreementBoard* board, std::span<int64_t> words) {
  if (words.empty()) return;
  if (board == nullptr) {
    host.all_reduce(words.data(), words.data(), int64_t(words.size()), kInt64, ReduceOp::Max);
    return;
  }
  for (size_t start = 0; start < words.size(); start += kRoundWords) {
    int64_t round[kRoundWords] = {};
    const size_t n = std::min(kRoundWords, words.size() - start);
    std::copy_n(words.begin() + ptrdiff_t(start), n, round);
    board->max(round);
    std::copy_n(round, n, words.begin() + ptrdiff_t(start));
  }
}

}  // namespace detail

using namespace detail;

void agree_max(std::span<int64_t> words, const Group& group) {
  Call c(Op::Agree, group);
  Fingerprint print;
  print.op = static_cast<int32_t>(c.op);
  print.rank = runtime().rank;
  print.dtype = static_cast<int32_t>(kInt64);
  print.ndim = 1;
  print.dims[0] = int64_t(words.size());
  print.wire = static_cast<int32_t>(DeviceType::CPU);
  print.from_backward = autograd::in_backward() ? 1 : 0;
  // The words travel in the agreement step itself: the call has no body of its own.
  issue(
      c, print, true, [] {}, false, words);
}

std::vector<int64_t> agree_max(std::vector<int64_t> words, const Group& group) {
  agree_max(std::span<int64_t>(words), group);
  return words;
}

MemoryPeaks max_memory_stats(Device device, const Group& group) {
  const MemoryStats mine = memory_stats(device);
  // value x n + (n - 1 - rank): the maximum is the largest value, at its lowest rank.
  const int64_t n = group.size(), me = group.rank();
  std::vector<int64_t> words = {int64_t(mine.peak) * n + (n - 1 - me),
                                int64_t(mine.resident_peak) * n + (n - 1 - me)};
  agree_max(std::span<int64_t>(words), group);
  const auto rank_of = [&](int64_t word) { return group.global_rank(int(n - 1 - word % n)); };
  return {.tensor_peak = size_t(words[0] / n),
          .tensor_rank = rank_of(words[0]),
          .resident_peak = size_t(words[1] / n),
          .resident_rank = rank_of(words[1])};
}

}  // namespace weave::dist

// Agreement over a group: every question is answered by dist::agree_max over int64 words, and
// every byte exchange moves its lengths first.
#include "weave/parallel/core/agree.h"

#include <algorithm>
#include <cstring>

#include "weave/autograd/grad_mode.h"
#include "weave/ops/ops.h"
#include "weave/tensor/checksum.h"

namespace weave::parallel::detail {

namespace {

// `values` then their negations: the maxima of both give the range.
std::vector<int64_t> with_negations(const std::vector<int64_t>& values) {
  std::vector<int64_t> words = values;
  for (int64_t v : values) words.push_back(-v);
  return words;
}

ValueRange range_of(const std::vector<int64_t>& maxima, size_t n) {
  ValueRange range;
  for (size_t i = 0; i < n; ++i) {
    range.highest.push_back(maxima[i]);
    range.lowest.push_back(-maxima[n + i]);
  }
  return range;
}

// The one skeleton of "do this, then learn whether every rank did": runs `work` (catching
// anything: the peers must learn of a failure whatever its type), then takes the maxima of
// `values` (as `work` left them) and of their negations, with the failure flag, in one
// agreement; re-raises this rank's own error, or calls `peer_failed` (which raises) when
// another rank's work failed. Returns the range of the values.
ValueRange together(const std::function<void()>& work, const std::vector<int64_t>& values,
                    const dist::Group& group, const std::function<void()>& peer_failed) {
  std::exception_ptr mine;
  try {
    work();
  } catch (...) {
    mine = std::current_exception();
  }
  std::vector<int64_t> words = with_negations(values);
  words.push_back(mine ? 1 : 0);  // last: whether any rank's work raised
  words = dist::agree_max(std::move(words), group);
  if (mine) std::rethrow_exception(mine);
  if (words.back() != 0) peer_failed();
  return range_of(words, values.size());
}

Tensor bytes_tensor(const std::string& bytes) {
  Tensor t = empty({int64_t(bytes.size())}, {.dtype = kUInt8});
  if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

std::string string_of(const Tensor& bytes, int64_t offset, int64_t length) {
  const auto* data = static_cast<const char*>(bytes.data_ptr());
  return length == 0 ? std::string() : std::string(data + offset, data + offset + length);
}

std::vector<int64_t> all_lengths(const std::string& mine, const dist::Group& group) {
  Tensor lengths = empty({group.size()}, {.dtype = kInt64});
  dist::all_gather(lengths, full({1}, double(mine.size()), {.dtype = kInt64}), group);
  return lengths.to_vector<int64_t>();
}

}  // namespace

bool all_agree(bool mine, const dist::Group& group) {
  return dist::agree_max({mine ? 0 : 1}, group)[0] == 0;
}

void run_together(const char* op, const dist::Group& group, const std::string& what,
                  const std::function<void()>& step) {
  together(step, {}, group, [&] {
    WEAVE_FAIL(op, "another rank of group {} failed to {}; see its error", group.str(), what);
  });
}

ValueRange value_range(const std::vector<int64_t>& values, const dist::Group& group) {
  return range_of(dist::agree_max(with_negations(values), group), values.size());
}

ValueRange check_together(const std::function<void()>& checks, const dist::Group& group,
                          const char* op, const std::vector<int64_t>& values) {
  return together(checks, values, group, [&] {
    WEAVE_FAIL(op,
               "a rank of group {} rejected its arguments (see its error), so every rank raises "
               "before anything is sent",
               group.str());
  });
}

std::vector<std::vector<int>> ranks_where(const std::vector<bool>& facts,
                                          const dist::Group& group) {
  // One word per fact and rank, each rank setting its own: the maximum marks every rank's.
  const size_t n = size_t(group.size()), me = size_t(group.rank());
  std::vector<int64_t> words(facts.size() * n, 0);
  for (size_t f = 0; f < facts.size(); ++f) words[f * n + me] = facts[f] ? 1 : 0;
  words = dist::agree_max(std::move(words), group);
  std::vector<std::vector<int>> ranks(facts.size());
  for (size_t f = 0; f < facts.size(); ++f)
    for (size_t r = 0; r < n; ++r)
      if (words[f * n + r] != 0) ranks[f].push_back(int(r));
  return ranks;
}

std::vector<std::string> all_gather_bytes(const std::string& mine, const dist::Group& group) {
  const std::vector<int64_t> lengths = all_lengths(mine, group);
  const Tensor all = dist::all_gather_uneven(bytes_tensor(mine), group);
  std::vector<std::string> out;
  int64_t offset = 0;
  for (int64_t length : lengths) {
    out.push_back(string_of(all, offset, length));
    offset += length;
  }
  return out;
}

std::string broadcast_bytes(const std::string& bytes, int root, const dist::Group& group) {
  const bool is_root = group.rank() == root;
  Tensor length = full({1}, is_root ? double(bytes.size()) : 0.0, {.dtype = kInt64});
  dist::broadcast(length, root, group);
  const int64_t n = length.item<int64_t>();
  if (n == 0) return {};
  Tensor data = is_root ? bytes_tensor(bytes) : empty({n}, {.dtype = kUInt8});
  dist::broadcast(data, root, group);
  return is_root ? bytes : string_of(data, 0, n);
}

std::vector<std::string> gather_bytes(const std::string& mine, int root, const dist::Group& group) {
  const std::vector<int64_t> lengths = all_lengths(mine, group);
  if (group.rank() != root) {
    if (!mine.empty()) dist::send(bytes_tensor(mine), root, group);
    return {};
  }
  std::vector<std::string> out(lengths.size());
  for (int r = 0; r < group.size(); ++r) {
    if (r == root) {
      out[size_t(r)] = mine;
    } else if (lengths[size_t(r)] > 0) {
      Tensor part = empty({lengths[size_t(r)]}, {.dtype = kUInt8});
      dist::recv(part, r, group);
      out[size_t(r)] = string_of(part, 0, part.numel());
    }
  }
  return out;
}

std::string lines_disagreement(const std::vector<std::string>& lines, const dist::Group& group,
                               const std::string& what, const std::string& hint) {
  std::string text;
  for (const std::string& line : lines) text += line + '\n';
  std::vector<std::vector<std::string>> all;
  for (const std::string& rank_text : all_gather_bytes(text, group)) {
    std::vector<std::string>& rank_lines = all.emplace_back();
    for (size_t start = 0; start < rank_text.size();) {
      const size_t end = rank_text.find('\n', start);
      rank_lines.push_back(rank_text.substr(start, end - start));
      start = end + 1;
    }
  }
  const auto& first = all[0];
  for (size_t r = 1; r < all.size(); ++r) {
    const auto& theirs = all[r];
    for (size_t i = 0; i < std::max(first.size(), theirs.size()); ++i) {
      const std::string a = i < first.size() ? first[i] : "nothing";
      const std::string b = i < theirs.size() ? theirs[i] : "nothing";
      if (a != b)
        return fmt::format(
            "ranks disagree on {}: entry {} is '{}' on rank {} but '{}' on rank {}; "
            "hint: {}",
            what, i, a, group.global_rank(0), b, group.global_rank(int(r)), hint);
    }
  }
  return {};
}

void check_same_lines(const std::vector<std::string>& lines, const dist::Group& group,
                      const char* op, const std::string& what, const std::string& hint) {
  const std::string disagreement = lines_disagreement(lines, group, what, hint);
  WEAVE_CHECK(disagreement.empty(), op, "{}", disagreement);
}

void Verdict::check(const std::function<void()>& check) {
  try {
    check();
  } catch (const std::exception& e) {
    if (error_.empty()) error_ = e.what();
  }
}

void Verdict::note(const std::string& error) {
  if (error_.empty() && !error.empty()) error_ = fmt::format("[{}] {}", op_, error);
}

void Verdict::share(const dist::Group& group) {
  const std::vector<std::string> all = all_gather_bytes(error_, group);
  if (!error_.empty()) return;
  for (int r = 0; r < group.size(); ++r)
    if (!all[size_t(r)].empty()) {
      error_ = all[size_t(r)];
      if (error_.find(" (found on rank ") == std::string::npos)
        error_ += fmt::format(" (found on rank {})", group.global_rank(r));
      return;
    }
}

void Verdict::raise_if_failed() const {
  if (!error_.empty()) ::weave::detail::throw_error(error_);
}

std::vector<std::string> describe_tensors(const std::vector<Tensor>& tensors) {
  std::vector<std::string> lines;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    lines.push_back(t.defined() ? fmt::format("parameter {} {} {}", i, t.dtype(), t.shape())
                                : fmt::format("parameter {} undefined", i));
  }
  return lines;
}

std::vector<std::string> describe_values(const std::vector<Tensor>& tensors) {
  std::vector<std::string> lines;
  for (size_t i = 0; i < tensors.size(); ++i)
    lines.push_back(fmt::format("parameter {} crc32 {:08x}", i,
                                tensors[i].defined() ? checksum(tensors[i]) : 0u));
  return lines;
}

}  // namespace weave::parallel::detail

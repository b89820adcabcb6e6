// Collective comparison of what every rank must hold alike.
#include "weave/parallel/agree.h"

#include <algorithm>
#include <cstring>

#include "weave/autograd/grad_mode.h"
#include "weave/data/safetensors.h"
#include "weave/nn/module.h"

namespace weave::parallel::detail {

namespace {

// Every rank's lines, gathered as one '\n'-joined byte string per rank.
std::vector<std::vector<std::string>> gather_lines(const std::vector<std::string>& lines,
                                                   const dist::Group& group) {
  std::string text;
  for (const std::string& line : lines) text += line + '\n';
  Tensor bytes = empty({int64_t(text.size())}, {.dtype = kUInt8});
  if (!text.empty()) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  Tensor lengths = empty({group.size()}, {.dtype = kInt64});
  dist::all_gather(lengths, full({1}, double(text.size()), {.dtype = kInt64}), group);
  Tensor all = dist::all_gather_uneven(bytes, group);
  std::vector<std::vector<std::string>> per_rank;
  const auto* data = static_cast<const char*>(all.data_ptr());
  int64_t offset = 0;
  for (int64_t length : lengths.to_vector<int64_t>()) {
    std::vector<std::string> rank_lines;
    std::string rank_text(data + offset, data + offset + length);
    offset += length;
    for (size_t start = 0; start < rank_text.size();) {
      size_t end = rank_text.find('\n', start);
      rank_lines.push_back(rank_text.substr(start, end - start));
      start = end + 1;
    }
    per_rank.push_back(std::move(rank_lines));
  }
  return per_rank;
}

}  // namespace

void check_same_lines(const std::vector<std::string>& lines, const dist::Group& group,
                      const char* op, const std::string& what, const std::string& hint) {
  const auto all = gather_lines(lines, group);
  const auto& first = all[0];
  for (size_t r = 1; r < all.size(); ++r) {
    const auto& theirs = all[r];
    for (size_t i = 0; i < std::max(first.size(), theirs.size()); ++i) {
      const std::string a = i < first.size() ? first[i] : "nothing";
      const std::string b = i < theirs.size() ? theirs[i] : "nothing";
      WEAVE_CHECK(a == b, op,
                  "ranks disagree on {}: entry {} is '{}' on rank {} but '{}' on rank {}; hint: {}",
                  what, i, a, group.global_rank(0), b, group.global_rank(int(r)), hint);
    }
  }
}

std::vector<int64_t> check_together(const std::function<void()>& checks, const dist::Group& group,
                                    const char* op, std::vector<int64_t> values) {
  std::exception_ptr mine;
  try {
    checks();
  } catch (...) {  // any type: the peers must learn of it all the same
    mine = std::current_exception();
  }
  values.push_back(mine ? 1 : 0);  // last: whether any rank's checks raised
  std::vector<int64_t> maxima;
  {
    NoGradGuard no_grad;
    Tensor packed = from_vector<int64_t>(values, {int64_t(values.size())});
    dist::all_reduce(packed, dist::ReduceOp::Max, group);
    maxima = packed.to_vector<int64_t>();
  }
  if (mine) std::rethrow_exception(mine);
  WEAVE_CHECK(maxima.back() == 0, op,
              "a rank of group {} rejected its arguments (see its error), so every rank raises "
              "before anything is sent",
              group.str());
  maxima.pop_back();
  return maxima;
}

void check_same_model(const nn::Module& module, const dist::Group& group, const char* op) {
  std::vector<std::string> lines;
  for (const auto& [name, t] : module.named_parameters())
    lines.push_back(fmt::format("parameter {} {} {}", name, t.dtype(), t.shape()));
  for (const auto& [name, t] : module.named_buffers())
    lines.push_back(fmt::format("buffer {} {} {}", name, t.dtype(), t.shape()));
  check_same_lines(lines, group, op, "the model",
                   "build the same model (same layers, shapes and dtypes) on every rank");
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
                                tensors[i].defined() ? data::checksum(tensors[i]) : 0u));
  return lines;
}

}  // namespace weave::parallel::detail

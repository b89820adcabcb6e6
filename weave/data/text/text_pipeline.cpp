#include "weave/data/text/text_pipeline.h"

#include "weave/data/text/unicode.h"

namespace weave::data {
namespace {

bool is_space_at(std::string_view text, size_t i) {
  return unicode::classes_of(unicode::char_at(text, i).code) & unicode::kSpace;
}

void strip(std::string& text, bool left, bool right) {
  size_t begin = 0, end = text.size();
  while (left && begin < end && is_space_at(text, begin))
    begin += unicode::char_at(text, begin).size;
  while (right && end > begin) {
    size_t last = end - 1;  // back to the last character's first byte
    while (last > begin && (uint8_t(text[last]) & 0xC0) == 0x80) --last;
    if (unicode::char_at(text, last).size != end - last || !is_space_at(text, last)) break;
    end = last;
  }
  text = text.substr(begin, end - begin);
}

void normalize(const NormalizerStep& step, std::string& text) {
  switch (step.kind) {
    case NormalizerStep::kUnicode:
      text = unicode::normalize(text, step.form);
      return;
    case NormalizerStep::kReplace:
      replace_all(text, step.pattern, step.content);
      return;
    case NormalizerStep::kPrepend:
      if (!text.empty()) text.insert(0, step.content);
      return;
    case NormalizerStep::kStrip:
      strip(text, step.strip_left, step.strip_right);
      return;
  }
}

// The text transformation a first pre-tokenizer step makes before it splits.
void prepare(const PreTokenizerStep& step, bool at_start, std::string& text) {
  if (step.kind == PreTokenizerStep::kByteLevel && step.add_prefix_space && !text.empty() &&
      text[0] != ' ')
    text.insert(0, " ");
  if (step.kind != PreTokenizerStep::kMetaspace) return;
  replace_all(text, " ", step.literal);
  const bool prepend = step.prepend == PreTokenizerStep::Prepend::kAlways ||
                       (step.prepend == PreTokenizerStep::Prepend::kFirst && at_start);
  if (prepend && !text.empty() && !text.starts_with(step.literal)) text.insert(0, step.literal);
}

bool splits(const PreTokenizerStep& step) {
  if (step.kind == PreTokenizerStep::kByteLevel) return step.pattern.has_value();
  return step.kind != PreTokenizerStep::kMetaspace || step.metaspace_split;
}

void split_piece(const PreTokenizerStep& step, std::string_view piece,
                 std::vector<std::string_view>& out) {
  switch (step.kind) {
    case PreTokenizerStep::kSplit:
    case PreTokenizerStep::kByteLevel:
      return split_with_behavior(piece, &*step.pattern, {}, step.behavior, out);
    case PreTokenizerStep::kSplitString:
      return split_with_behavior(piece, nullptr, step.literal, step.behavior, out);
    case PreTokenizerStep::kMetaspace:
      return split_with_behavior(piece, nullptr, step.literal, SplitBehavior::kMergedWithNext, out);
  }
}

}  // namespace

void replace_all(std::string& text, std::string_view from, std::string_view to) {
  if (from.empty() || text.find(from) == std::string::npos) return;
  std::string out;
  out.reserve(text.size() + text.size() / 4);
  size_t start = 0;
  for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, start)) {
    out.append(text, start, at - start);
    out.append(to);
    start = at + from.size();
  }
  out.append(text, start);
  text = std::move(out);
}

void split_with_behavior(std::string_view text, const SplitPattern* pattern,
                         std::string_view literal, SplitBehavior behavior,
                         std::vector<std::string_view>& out) {
  if (behavior == SplitBehavior::kIsolated && pattern) return pattern->split(text, out);
  std::vector<std::string_view> cut;  // matches and the text between them, in order
  std::vector<bool> matches;
  if (pattern) {
    pattern->split(text, cut, &matches);
  } else {
    size_t start = 0;
    for (size_t at = text.find(literal); !literal.empty() && at != std::string_view::npos;
         at = text.find(literal, start)) {
      if (at > start) cut.push_back(text.substr(start, at - start)), matches.push_back(false);
      cut.push_back(text.substr(at, literal.size()));
      matches.push_back(true);
      start = at + literal.size();
    }
    if (start < text.size()) cut.push_back(text.substr(start)), matches.push_back(false);
  }
  if (behavior == SplitBehavior::kIsolated) {
    out.insert(out.end(), cut.begin(), cut.end());
    return;
  }
  const size_t first_out = out.size();
  bool previous_match = false;
  const auto join = [](std::string_view a, std::string_view b) {
    return std::string_view(a.data(), size_t(b.data() + b.size() - a.data()));
  };
  if (behavior == SplitBehavior::kMergedWithNext) {
    std::vector<std::string_view> reversed;
    for (size_t k = cut.size(); k-- > 0;) {
      if (matches[k] && !previous_match && !reversed.empty())
        reversed.back() = join(cut[k], reversed.back());
      else
        reversed.push_back(cut[k]);
      previous_match = matches[k];
    }
    out.insert(out.end(), reversed.rbegin(), reversed.rend());
    return;
  }
  for (size_t k = 0; k < cut.size(); ++k) {
    const bool merge = behavior == SplitBehavior::kMergedWithPrevious
                           ? matches[k] && !previous_match
                           : behavior == SplitBehavior::kContiguous && matches[k] && previous_match;
    if (behavior == SplitBehavior::kRemoved && matches[k]) {
    } else if (merge && out.size() > first_out) {
      out.back() = join(out.back(), cut[k]);
    } else {
      out.push_back(cut[k]);
    }
    previous_match = matches[k];
  }
}

void TextPipeline::pieces(std::string_view section, bool at_start, std::string& storage,
                          std::vector<std::string_view>& out) const {
  const bool rewrites =
      !normalizers.empty() ||
      (!pre_tokenizers.empty() && (pre_tokenizers[0].kind == PreTokenizerStep::kMetaspace ||
                                   pre_tokenizers[0].add_prefix_space));
  std::string_view text = section;
  if (rewrites) {
    storage.assign(section);
    for (const NormalizerStep& step : normalizers) normalize(step, storage);
    if (!pre_tokenizers.empty()) prepare(pre_tokenizers[0], at_start, storage);
    text = storage;
  }
  if (text.empty()) return;
  // Each splitting step cuts every piece of the step before; the last one writes into `out`.
  size_t last = pre_tokenizers.size();
  for (size_t k = 0; k < pre_tokenizers.size(); ++k)
    if (splits(pre_tokenizers[k])) last = k;
  if (last == pre_tokenizers.size()) return out.push_back(text);
  std::vector<std::string_view> pieces{text}, next;
  for (size_t k = 0; k <= last; ++k) {
    if (!splits(pre_tokenizers[k])) continue;
    std::vector<std::string_view>& into = k == last ? out : next;
    for (std::string_view piece : pieces) split_piece(pre_tokenizers[k], piece, into);
    if (k < last) pieces.swap(next), next.clear();
  }
}

}  // namespace weave::data

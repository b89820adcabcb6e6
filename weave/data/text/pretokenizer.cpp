#include "weave/data/text/pretokenizer.h"

#include <algorithm>
#include <array>
#include <cstdint>

namespace weave::data {
namespace {

enum CharClass : uint8_t { kOther, kLetter, kNumber, kSpace };

struct UnicodeRange {
  uint32_t first, last;
  CharClass cls;
};

constexpr UnicodeRange kRanges[] = {
#include "weave/data/text/unicode_classes.inc"
};

constexpr std::array<CharClass, 128> ascii_classes() {
  std::array<CharClass, 128> table{};
  for (int c = 'a'; c <= 'z'; ++c) table[size_t(c)] = kLetter;
  for (int c = 'A'; c <= 'Z'; ++c) table[size_t(c)] = kLetter;
  for (int c = '0'; c <= '9'; ++c) table[size_t(c)] = kNumber;
  for (int c : {'\t', '\n', '\v', '\f', '\r', ' '}) table[size_t(c)] = kSpace;
  return table;
}
constexpr std::array<CharClass, 128> kAscii = ascii_classes();

constexpr uint32_t kInvalid = 0xFFFFFFFF;  // a byte outside valid UTF-8

struct Char {
  uint32_t code;  // the code point, or kInvalid
  uint32_t size;  // bytes
  CharClass cls;
};

CharClass class_of(uint32_t code) {
  if (code < 128) return kAscii[code];
  if (code == kInvalid) return kOther;
  const auto* after =
      std::upper_bound(std::begin(kRanges), std::end(kRanges), code,
                       [](uint32_t c, const UnicodeRange& r) { return c < r.first; });
  if (after == std::begin(kRanges)) return kOther;
  const UnicodeRange& range = *(after - 1);
  return code <= range.last ? range.cls : kOther;
}

// Decodes the UTF-8 character at text[i] (i < size); rejects overlong forms, surrogates and
// code points past U+10FFFF, one byte at a time.
[[gnu::noinline]] Char multibyte_char_at(std::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return uint8_t(text[k]); };
  const uint8_t lead = byte(i);
  uint32_t size = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 0;
  if (size == 0 || lead > 0xF4 || i + size > text.size()) return {kInvalid, 1, kOther};
  uint32_t code = lead & (0x7F >> size);
  for (uint32_t k = 1; k < size; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return {kInvalid, 1, kOther};
    code = (code << 6) | (byte(i + k) & 0x3F);
  }
  constexpr uint32_t kSmallest[] = {0, 0, 0x80, 0x800, 0x10000};
  if (code < kSmallest[size] || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF))
    return {kInvalid, 1, kOther};
  return {code, size, class_of(code)};
}

inline Char char_at(std::string_view text, size_t i) {
  const auto lead = uint8_t(text[i]);
  return lead < 0x80 ? Char{lead, 1, kAscii[lead]} : multibyte_char_at(text, i);
}

class Splitter {
 public:
  Splitter(std::string_view text, SplitRule rule) : text_(text), rule_(rule) {}

  size_t piece_end(size_t i) const {
    const Char c = char_at(text_, i);
    if (c.code == '\'')
      if (size_t end = contraction_end(i + 1); end) return end;
    return rule_ == SplitRule::kGpt2 ? gpt2_end(i, c) : llama3_end(i, c);
  }

 private:
  bool done(size_t i) const { return i >= text_.size(); }
  Char at(size_t i) const { return char_at(text_, i); }

  // 's 't 're 've 'm 'll 'd after the apostrophe at i - 1 (any case for Llama 3, where
  // Unicode case folding also takes U+017F, the long s, for s).
  size_t contraction_end(size_t i) const {
    const bool any_case = rule_ != SplitRule::kGpt2;
    if (done(i)) return 0;
    if (any_case && at(i).code == 0x17F) return i + 2;  // U+017F folds to s; two bytes
    const auto lower = [&](size_t k) -> char {
      if (done(k)) return 0;
      const char c = text_[k];
      return any_case && c >= 'A' && c <= 'Z' ? char(c + 32) : c;
    };
    const char first = lower(i), second = lower(i + 1);
    if (first == 's' || first == 't' || first == 'm' || first == 'd') return i + 1;
    if ((first == 'r' || first == 'v') && second == 'e') return i + 2;
    if (first == 'l' && second == 'l') return i + 2;
    return 0;
  }

  size_t run_end(size_t i, CharClass cls, size_t max_chars = SIZE_MAX) const {
    for (size_t n = 0; !done(i) && n < max_chars; ++n) {
      const Char c = at(i);
      if (c.cls != cls) break;
      i += c.size;
    }
    return i;
  }

  // The white space starting at i: the run's end, where its last character starts, and where
  // its last \r or \n ends (0 when none).
  struct SpaceRun {
    size_t end, last_start, last_newline_end;
  };
  SpaceRun space_run(size_t i) const {
    SpaceRun run{i, i, 0};
    while (!done(run.end)) {
      const Char c = at(run.end);
      if (c.cls != kSpace) break;
      run.last_start = run.end;
      run.end += c.size;
      if (c.code == '\r' || c.code == '\n') run.last_newline_end = run.end;
    }
    return run;
  }

  // \s+(?!\S)|\s+ at i: the run, less its last character when a non-space follows a run of
  // two or more.
  size_t trailing_space_end(size_t i, const SpaceRun& run) const {
    if (done(run.end) || run.last_start == i) return run.end;
    return run.last_start;
  }

  size_t gpt2_end(size_t i, const Char& c) const {
    size_t start = i;
    CharClass cls = c.cls;
    if (c.code == ' ' && !done(i + 1) && at(i + 1).cls != kSpace)
      start = i + 1, cls = at(i + 1).cls;
    if (cls != kSpace) return run_end(start, cls);
    return trailing_space_end(i, space_run(i));
  }

  size_t llama3_end(size_t i, const Char& c) const {
    const bool newline = c.code == '\r' || c.code == '\n';
    if (c.cls == kLetter) return run_end(i, kLetter);
    if (c.cls != kNumber && !newline && !done(i + c.size) && at(i + c.size).cls == kLetter)
      return run_end(i + c.size, kLetter);
    if (c.cls == kNumber)
      return run_end(i, kNumber, rule_ == SplitRule::kLlama3SingleDigits ? 1 : 3);
    size_t start = i;
    if (c.code == ' ' && !done(i + 1) && at(i + 1).cls == kOther) start = i + 1;
    if (at(start).cls == kOther) {
      size_t end = run_end(start, kOther);
      while (!done(end) && (text_[end] == '\r' || text_[end] == '\n')) ++end;
      return end;
    }
    const SpaceRun run = space_run(i);
    if (run.last_newline_end) return run.last_newline_end;
    return trailing_space_end(i, run);
  }

  std::string_view text_;
  SplitRule rule_;
};

}  // namespace

void split_pieces(std::string_view text, SplitRule rule, std::vector<std::string_view>& pieces) {
  const Splitter splitter(text, rule);
  for (size_t i = 0; i < text.size();) {
    const size_t end = splitter.piece_end(i);
    pieces.push_back(text.substr(i, end - i));
    i = end;
  }
}

}  // namespace weave::data

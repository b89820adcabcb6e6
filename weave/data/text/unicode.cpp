#include "weave/data/text/unicode.h"

#include <algorithm>
#include <array>

namespace weave::data::unicode {
namespace {

struct ClassRange {
  char32_t first, last;
  uint16_t classes;
};

constexpr ClassRange kRanges[] = {
#include "weave/data/text/unicode_classes.inc"
};

uint16_t search(char32_t code) {
  const auto* after = std::upper_bound(std::begin(kRanges), std::end(kRanges), code,
                                       [](char32_t c, const ClassRange& r) { return c < r.first; });
  if (after == std::begin(kRanges)) return 0;
  const ClassRange& range = *(after - 1);
  return code <= range.last ? range.classes : 0;
}

constexpr std::array<uint16_t, 128> ascii_classes() {
  std::array<uint16_t, 128> table{};
  for (const ClassRange& r : kRanges)
    for (char32_t c = r.first; c <= r.last && c < 128; ++c) table[c] = r.classes;
  return table;
}
constexpr std::array<uint16_t, 128> kAscii = ascii_classes();

}  // namespace

uint16_t classes_of(char32_t code) {
  if (code < 128) return kAscii[code];
  return code == kInvalid ? 0 : search(code);
}

// Rejects overlong forms, surrogates and code points past U+10FFFF, one byte at a time.
Char multibyte_char_at(std::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return uint8_t(text[k]); };
  const uint8_t lead = byte(i);
  const uint32_t size = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 0;
  if (size == 0 || lead > 0xF4 || i + size > text.size()) return {kInvalid, 1};
  char32_t code = lead & (0x7F >> size);
  for (uint32_t k = 1; k < size; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return {kInvalid, 1};
    code = (code << 6) | (byte(i + k) & 0x3F);
  }
  constexpr char32_t kSmallest[] = {0, 0, 0x80, 0x800, 0x10000};
  if (code < kSmallest[size] || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF))
    return {kInvalid, 1};
  return {code, size};
}

void append_utf8(std::string& out, char32_t code) {
  if (code < 0x80) {
    out.push_back(char(code));
  } else if (code < 0x800) {
    out.push_back(char(0xC0 | (code >> 6)));
    out.push_back(char(0x80 | (code & 0x3F)));
  } else if (code < 0x10000) {
    out.push_back(char(0xE0 | (code >> 12)));
    out.push_back(char(0x80 | ((code >> 6) & 0x3F)));
    out.push_back(char(0x80 | (code & 0x3F)));
  } else {
    out.push_back(char(0xF0 | (code >> 18)));
    out.push_back(char(0x80 | ((code >> 12) & 0x3F)));
    out.push_back(char(0x80 | ((code >> 6) & 0x3F)));
    out.push_back(char(0x80 | (code & 0x3F)));
  }
}

}  // namespace weave::data::unicode

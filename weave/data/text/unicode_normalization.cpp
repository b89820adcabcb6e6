// Decomposition (canonical or compatibility, by table; Hangul syllables by arithmetic), the
// canonical ordering of combining marks, and canonical composition, from the tables
// scripts/unicode-normalization.py writes.
#include "weave/data/text/unicode_normalization.h"

#include "weave/data/text/unicode.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace weave::data::unicode {
namespace {

struct CombiningRange {
  char32_t first, last;
  uint8_t combining_class;
};
struct Decomposition {
  char32_t code;
  uint8_t compatibility;  // 1: NFKD's mapping where it differs from NFD's
  uint16_t offset, size;  // in kDecompositionPool
};
struct Composition {
  char32_t first, second, composite;
};

#include "weave/data/text/unicode_normalization.inc"

constexpr char32_t kHangulBase = 0xAC00, kLeadBase = 0x1100, kVowelBase = 0x1161,
                   kTrailBase = 0x11A7;
constexpr char32_t kVowels = 21, kTrails = 28, kSyllables = 11172;

uint8_t combining_class(char32_t c) {
  if (c < 0x300 || c == kInvalid) return 0;
  const auto* after =
      std::upper_bound(std::begin(kCombiningClasses), std::end(kCombiningClasses), c,
                       [](char32_t x, const CombiningRange& r) { return x < r.first; });
  if (after == std::begin(kCombiningClasses)) return 0;
  return c <= (after - 1)->last ? (after - 1)->combining_class : 0;
}

// Appends the full decomposition of c (c itself where it has none).
void decompose(char32_t c, bool compatibility, std::vector<char32_t>& out) {
  if (c >= kHangulBase && c < kHangulBase + kSyllables) {
    const char32_t s = c - kHangulBase;
    out.push_back(kLeadBase + s / (kVowels * kTrails));
    out.push_back(kVowelBase + (s % (kVowels * kTrails)) / kTrails);
    if (s % kTrails) out.push_back(kTrailBase + s % kTrails);
    return;
  }
  if (c < 0xC0 || c == kInvalid) return out.push_back(c);
  const auto* entry =
      std::lower_bound(std::begin(kDecompositions), std::end(kDecompositions), c,
                       [](const Decomposition& d, char32_t code) { return d.code < code; });
  const Decomposition* chosen = nullptr;
  // The canonical entry comes first, the compatibility one (where it differs) second.
  for (; entry != std::end(kDecompositions) && entry->code == c; ++entry)
    if (!entry->compatibility || compatibility) chosen = entry;
  if (!chosen) return out.push_back(c);
  out.insert(out.end(), kDecompositionPool + chosen->offset,
             kDecompositionPool + chosen->offset + chosen->size);
}

// Sorts each run of non-starters by combining class, keeping the order of equals.
void reorder(std::vector<char32_t>& chars) {
  for (size_t i = 0; i < chars.size();) {
    if (combining_class(chars[i]) == 0) {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < chars.size() && combining_class(chars[end]) != 0) ++end;
    std::stable_sort(
        chars.begin() + std::ptrdiff_t(i), chars.begin() + std::ptrdiff_t(end),
        [](char32_t a, char32_t b) { return combining_class(a) < combining_class(b); });
    i = end;
  }
}

char32_t compose_pair(char32_t first, char32_t second) {
  if (first >= kLeadBase && first < kLeadBase + 19 && second >= kVowelBase &&
      second < kVowelBase + kVowels)
    return kHangulBase + ((first - kLeadBase) * kVowels + (second - kVowelBase)) * kTrails;
  if (first >= kHangulBase && first < kHangulBase + kSyllables &&
      (first - kHangulBase) % kTrails == 0 && second > kTrailBase && second < kTrailBase + kTrails)
    return first + (second - kTrailBase);
  const Composition key{first, second, 0};
  const auto* found = std::lower_bound(
      std::begin(kCompositions), std::end(kCompositions), key, [](const auto& a, const auto& b) {
        return a.first != b.first ? a.first < b.first : a.second < b.second;
      });
  if (found != std::end(kCompositions) && found->first == first && found->second == second)
    return found->composite;
  return 0;
}

// Canonical composition: each character joins the last starter unless a character between them
// has a combining class as high or is a starter.
void compose(std::vector<char32_t>& chars) {
  if (chars.empty()) return;
  size_t starter = SIZE_MAX, out = 0;
  int last_class = -1;
  for (size_t i = 0; i < chars.size(); ++i) {
    const char32_t c = chars[i];
    const int cls = combining_class(c);
    if (starter != SIZE_MAX && (out == starter + 1 || (last_class > 0 && last_class < cls)))
      if (const char32_t composite = compose_pair(chars[starter], c)) {
        chars[starter] = composite;
        continue;
      }
    if (cls == 0) starter = out;
    last_class = cls;
    chars[out++] = c;
  }
  chars.resize(out);
}

}  // namespace

std::string normalize(std::string_view text, Form form) {
  if (std::all_of(text.begin(), text.end(), [](char c) { return uint8_t(c) < 0x80; }))
    return std::string(text);
  const bool compatibility = form == Form::kNFKC || form == Form::kNFKD;
  std::vector<char32_t> chars;
  chars.reserve(text.size());
  std::vector<uint8_t> invalid_bytes;
  for (size_t i = 0; i < text.size();) {
    const Char c = char_at(text, i);
    if (c.code == kInvalid) invalid_bytes.push_back(uint8_t(text[i]));
    decompose(c.code, compatibility, chars);
    i += c.size;
  }
  reorder(chars);
  if (form == Form::kNFC || form == Form::kNFKC) compose(chars);
  std::string out;
  out.reserve(text.size());
  size_t next_invalid = 0;
  for (const char32_t c : chars) {
    if (c == kInvalid)
      out.push_back(char(invalid_bytes[next_invalid++]));
    else
      append_utf8(out, c);
  }
  return out;
}

}  // namespace weave::data::unicode

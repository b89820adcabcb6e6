#pragma once
// What the tokenizer reads text by: UTF-8 characters one at a time (a byte outside valid UTF-8
// counts as one character of no class, so any bytes can be tokenized) and the Unicode classes
// that split patterns name.
#include <cstdint>
#include <string>
#include <string_view>

namespace weave::data::unicode {

/// The classes of a code point, as bits: a character may be in several (a letter and upper case).
enum Class : uint16_t {
  kLetter = 1 << 0,       // \p{L}
  kNumber = 1 << 1,       // \p{N}
  kSpace = 1 << 2,        // \s: Unicode's White_Space (U+0085 is, U+FEFF is not)
  kUpper = 1 << 3,        // \p{Lu}
  kLower = 1 << 4,        // \p{Ll}
  kTitle = 1 << 5,        // \p{Lt}
  kModifier = 1 << 6,     // \p{Lm}
  kOtherLetter = 1 << 7,  // \p{Lo}
  kMark = 1 << 8,         // \p{M}
  kPunctuation = 1 << 9,  // \p{P}
  kSymbol = 1 << 10,      // \p{S}
  kDigit = 1 << 11,       // \p{Nd}, \d
};

/// A byte that starts no valid UTF-8 character (an overlong form, a surrogate, past U+10FFFF, a
/// stray continuation byte or a cut-off sequence).
constexpr char32_t kInvalid = 0xFFFFFFFF;

struct Char {
  char32_t code;  // the code point, or kInvalid
  uint32_t size;  // bytes: 1 for kInvalid
};

/// The classes of a code point (0 for kInvalid).
uint16_t classes_of(char32_t code);

Char multibyte_char_at(std::string_view text, size_t i);

/// The character at text[i] (i < text.size()).
inline Char char_at(std::string_view text, size_t i) {
  const auto lead = uint8_t(text[i]);
  return lead < 0x80 ? Char{lead, 1} : multibyte_char_at(text, i);
}

/// Appends the UTF-8 bytes of a code point (below U+110000, not a surrogate).
void append_utf8(std::string& out, char32_t code);

}  // namespace weave::data::unicode

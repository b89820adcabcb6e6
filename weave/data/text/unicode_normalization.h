#pragma once
// Unicode normalization forms (UAX #15), as Hugging Face's normalizers NFC, NFD, NFKC and NFKD
// apply them to text before it is split. Bytes outside valid UTF-8 pass through unchanged, each
// as a character that nothing composes with.
#include <string>
#include <string_view>

namespace weave::data::unicode {

enum class Form { kNFC, kNFD, kNFKC, kNFKD };

std::string normalize(std::string_view text, Form form);

}  // namespace weave::data::unicode

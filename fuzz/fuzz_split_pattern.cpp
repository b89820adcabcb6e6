// libFuzzer target: the first line of the input is read as a split pattern, the rest as text.
// Any pattern compiles or raises weave::Error; a compiled one cuts any bytes into pieces that
// concatenate to the text; each Unicode normalization form of the text is stable under itself.
// Never a crash, a sanitizer report or a hang.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "weave/data/text/pretokenizer.h"
#include "weave/data/text/unicode_normalization.h"
#include "weave/tensor/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t newline = input.find('\n');
  const std::string_view pattern = input.substr(0, newline);
  const std::string_view text =
      newline == std::string_view::npos ? std::string_view() : input.substr(newline + 1);
  using weave::data::unicode::Form;
  for (const Form form : {Form::kNFC, Form::kNFD, Form::kNFKC, Form::kNFKD}) {
    const std::string once = weave::data::unicode::normalize(text, form);
    if (weave::data::unicode::normalize(once, form) != once) std::abort();
  }
  try {
    const auto compiled = weave::data::SplitPattern::compile(std::string(pattern));
    std::vector<std::string_view> pieces;
    compiled.split(text, pieces);
    std::string joined;
    for (std::string_view piece : pieces) joined += piece;
    if (joined != text) std::abort();
  } catch (const weave::Error&) {
  }
  return 0;
}

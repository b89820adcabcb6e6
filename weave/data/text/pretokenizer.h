#pragma once
// The split rules of byte-level BPE tokenizers: text cut into pieces (words with their leading
// space, runs of digits, of punctuation, of white space) that BPE then encodes one by one.
// Each rule is the published regular expression written out by hand, with its alternation's
// leftmost-first order and backtracking; tests hold it to the reference encoders.
#include <string_view>
#include <vector>

namespace weave::data {

enum class SplitRule {
  /// GPT-2 (r50k, p50k): 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  kGpt2,
  /// Llama 3 and cl100k: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
  /// ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
  kLlama3,
  /// As kLlama3 with one digit a piece (\p{N} for \p{N}{1,3}; Qwen 2).
  kLlama3SingleDigits,
};

/// Appends the pieces of `text` to `pieces`, in order; they concatenate to `text`. Bytes that
/// are not valid UTF-8 count one by one as neither letter, number nor space.
void split_pieces(std::string_view text, SplitRule rule, std::vector<std::string_view>& pieces);

}  // namespace weave::data

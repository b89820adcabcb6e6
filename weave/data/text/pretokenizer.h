#pragma once
// The split patterns of byte-level BPE tokenizers: text cut into pieces (words with their leading
// space, runs of digits, of punctuation, of white space) that BPE then encodes one by one.
//
//   auto pattern = data::SplitPattern::compile(R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+|...)");
//   std::vector<std::string_view> pieces;
//   pattern.split("Hello world", pieces);   // {"Hello", " world"}
//
// A pattern is read by meaning, not matched against a list of known strings: any alternation of
// character classes (\p{L}, \p{N}, \p{Lu} and the other letter cases, \p{M}, \p{P}, \p{S}, \p{Nd},
// \s, their negations, literal characters and ranges, [...] and [^...]) with ?, *, +, {n,m},
// groups ((?:...), (?i:...)) and look-ahead ((?!...), (?=...)) is matched as Rust's regex crate
// (Hugging Face's tokenizers) and Python's regex module (tiktoken) match it: leftmost-first,
// greedy, backtracking. \s is Unicode's White_Space (U+0085 is, U+FEFF is not), as in Python
// and Rust. A pattern outside that (back-references, lazy quantifiers, \w, \b, anchors) raises,
// naming what it holds.
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace weave::data {

class SplitPattern {
 public:
  /// Compiles a pattern; raises weave::Error naming what it cannot read.
  static SplitPattern compile(std::string pattern);
  /// GPT-2's (r50k, p50k): 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+|
  /// ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  static const SplitPattern& gpt2();
  /// Llama 3's and cl100k's: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
  /// ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
  static const SplitPattern& llama3();

  SplitPattern(SplitPattern&&) noexcept;
  SplitPattern& operator=(SplitPattern&&) noexcept;
  SplitPattern(const SplitPattern&);
  SplitPattern& operator=(const SplitPattern&);
  ~SplitPattern();

  /// Appends the pieces of `text` to `pieces`, in order: each match, and the text between
  /// matches (Hugging Face's Split with behavior Isolated); they concatenate to `text`. Bytes
  /// that are not valid UTF-8 count one by one as characters of no class.
  /// With `matched`, also appends for each piece whether the pattern matched it (else it is text
  /// between matches).
  void split(std::string_view text, std::vector<std::string_view>& pieces,
             std::vector<bool>* matched = nullptr) const;
  /// The pattern as compiled.
  const std::string& source() const;

  struct Program;

 private:
  explicit SplitPattern(std::shared_ptr<const Program> program);
  std::shared_ptr<const Program> program_;
};

}  // namespace weave::data

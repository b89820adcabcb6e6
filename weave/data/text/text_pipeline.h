#pragma once
// What a tokenizer does to ordinary text (the text between added tokens) before its model merges
// it, as Hugging Face's tokenizer.json describes it: normalizers (Unicode forms, Replace, Prepend,
// Strip) and pre-tokenizer steps (Split by a pattern or a string, Metaspace, ByteLevel), each
// read from the JSON (text_pipeline_json.cpp) and applied here, in order.
#include "weave/data/text/pretokenizer.h"
#include "weave/data/text/unicode_normalization.h"

#include <nlohmann/json_fwd.hpp>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace weave::data {

struct NormalizerStep {
  enum Kind { kUnicode, kReplace, kPrepend, kStrip } kind;
  explicit NormalizerStep(Kind k) : kind(k) {}
  unicode::Form form = unicode::Form::kNFC;
  std::string pattern, content;  // kReplace: every `pattern` becomes `content`; kPrepend: content
  bool strip_left = false, strip_right = false;  // kStrip: white space at either end
};

/// How a Split keeps the pieces its pattern matches (Hugging Face's SplitDelimiterBehavior).
enum class SplitBehavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct PreTokenizerStep {
  enum Kind { kSplit, kSplitString, kMetaspace, kByteLevel } kind;
  explicit PreTokenizerStep(Kind k) : kind(k) {}
  std::optional<SplitPattern> pattern;  // kSplit; kByteLevel with use_regex: GPT-2's
  std::string literal;                  // kSplitString; kMetaspace: the replacement (U+2581)
  SplitBehavior behavior = SplitBehavior::kIsolated;
  enum class Prepend { kAlways, kFirst, kNever } prepend = Prepend::kAlways;  // kMetaspace
  bool metaspace_split = true;    // kMetaspace: cut before each replacement character
  bool add_prefix_space = false;  // kByteLevel: a space before text that has none
};

struct TextPipeline {
  std::vector<NormalizerStep> normalizers;
  std::vector<PreTokenizerStep> pre_tokenizers;

  /// The pieces of one section of ordinary text, in order; `storage` holds the normalized text
  /// they view when it differs from `section`. `at_start`: the section begins the text (for
  /// Metaspace's prepend_scheme "first").
  void pieces(std::string_view section, bool at_start, std::string& storage,
              std::vector<std::string_view>& out) const;
};

/// How token ids become text again (Hugging Face's decoder): ByteLevel, or the SentencePiece
/// style's Replace, ByteFallback, Fuse and Strip, or Metaspace.
struct DecoderSpec {
  bool byte_level = false;                                   // tokens in GPT-2's byte alphabet
  std::vector<std::pair<std::string, std::string>> replace;  // in each token, in order
  bool byte_fallback = false;                                // <0xNN> is the byte NN
  size_t strip_start = 0, strip_stop = 0;                    // spaces off the whole text's ends
};

/// Reads tokenizer.json's normalizer and pre_tokenizer; raises naming any step weave does not
/// implement. `byte_level` tells whether the pre-tokenizer holds ByteLevel.
TextPipeline read_text_pipeline(const nlohmann::json& normalizer, const nlohmann::json& pre,
                                const std::string& path, bool& byte_level);
/// Reads tokenizer.json's decoder (null: none, as byte-level files without one).
DecoderSpec read_decoder(const nlohmann::json& decoder, const std::string& path);

/// Replaces every occurrence of `from` in `text` by `to`, left to right (nothing when `from` is
/// empty): Replace normalizers and decoders, Metaspace's spaces.
void replace_all(std::string& text, std::string_view from, std::string_view to);

/// Cuts `text` at each match of a pattern (or each occurrence of a literal string) and keeps the
/// matches as `behavior` says.
void split_with_behavior(std::string_view text, const SplitPattern* pattern,
                         std::string_view literal, SplitBehavior behavior,
                         std::vector<std::string_view>& out);

}  // namespace weave::data

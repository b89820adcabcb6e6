#pragma once
// Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen 2 and others that publish one): text to token
// ids and back, in C++.
//
//   auto tok = data::Tokenizer::from_directory("gpt2/");   // tokenizer.json, or
//                                                          // vocab.json + merges.txt
//   std::vector<int32_t> ids = tok.encode("Hello world");   // {15496, 995}
//   std::string text = tok.decode(ids);                     // "Hello world"
//
// Encoding splits the text with the model's pre-tokenizer rule (data::SplitRule), maps each
// piece's bytes to symbols and applies the merges in rank order, as the published encoders do;
// tests hold it token for token to GPT-2's reference encoders. Any bytes encode, invalid UTF-8
// included, and decode(encode(x)) == x byte for byte.
#include "weave/data/text/pretokenizer.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace weave::data {

struct EncodeOptions {
  /// Special tokens (end-of-text and the like) written in the text become their ids; otherwise
  /// they are text like any other (tiktoken's encode_ordinary). Added tokens that are not
  /// special are always matched.
  bool allow_special = false;
  /// Prepends the tokens the model's post-processor puts in front of every sequence (Llama 3's
  /// <|begin_of_text|>); GPT-2 has none.
  bool add_special_tokens = false;
};

class Tokenizer {
 public:
  /// GPT-2's files: encoder.json (token -> id, tokens in the byte-to-character alphabet) and
  /// vocab.bpe (a version line, then one merge "left right" a line, in rank order). Hugging
  /// Face names the same files vocab.json and merges.txt.
  static Tokenizer from_gpt2_files(const std::string& encoder_json, const std::string& vocab_bpe);
  /// Hugging Face's tokenizer.json of a byte-level BPE model: model.type "BPE" without
  /// byte_fallback, a ByteLevel pre-tokenizer (alone, or after a Split by GPT-2's, Llama 3's or
  /// Qwen 2's pattern), no normalizer, and added tokens. Anything else raises, naming it.
  static Tokenizer from_hf_json(const std::string& path);
  /// tokenizer.json in dir, else vocab.json + merges.txt, else encoder.json + vocab.bpe.
  static Tokenizer from_directory(const std::string& dir);
  /// Writes Hugging Face's tokenizer.json (what from_hf_json reads back: the same ids for every
  /// text), tokenizer_config.json and special_tokens_map.json into dir (created), each file
  /// replaced atomically: what transformers' AutoTokenizer loads beside a model.
  void save_pretrained(const std::string& dir) const;
  /// Hugging Face's tokenizer.json text of this tokenizer.
  std::string hf_json() const;

  std::vector<int32_t> encode(std::string_view text, const EncodeOptions& options = {}) const;
  /// Encodes each text, on `threads` threads (0: the hardware's count).
  std::vector<std::vector<int32_t>> encode_batch(const std::vector<std::string>& texts,
                                                 const EncodeOptions& options = {},
                                                 int threads = 0) const;
  /// The bytes of the tokens, concatenated; raises for an id outside the vocabulary.
  std::string decode(std::span<const int32_t> ids) const;

  /// One past the largest id, added tokens included.
  int64_t vocab_size() const;
  /// The id of a token given as its text (special tokens included), if it has one.
  std::optional<int32_t> token_id(std::string_view text) const;
  /// The end-of-text token: "<|endoftext|>" (GPT-2) or "<|end_of_text|>" (Llama 3), if present.
  std::optional<int32_t> end_of_text() const;
  SplitRule split_rule() const;

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace weave::data

#pragma once
// BPE tokenizers as today's models ship them: byte-level (GPT-2, Llama 3, Qwen 2 and 3) and
// SentencePiece-style with byte fallback (Llama 2, Mistral, Gemma): text to token ids and back, in
// C++.
//
//   auto tok = data::Tokenizer::from_directory("gpt2/");   // tokenizer.json, or
//                                                          // vocab.json + merges.txt
//   std::vector<int32_t> ids = tok.encode("Hello world");   // {15496, 995}
//   std::string text = tok.decode(ids);                     // "Hello world"
//
// Encoding cuts the text at added tokens, normalizes each stretch between them (NFC, Replace,
// Prepend, ...), splits it with the model's pre-tokenizer (a data::SplitPattern, Metaspace),
// maps each piece to symbols (its bytes' tokens; or its characters', a character outside the
// vocabulary as <0xNN> byte tokens) and applies the merges in rank order, as the published
// encoders do; tests hold it token for token to GPT-2's reference encoders and to transformers.js
// on Llama 2's, Llama 3's, Gemma 3's and Qwen 3's files. Any bytes encode, invalid UTF-8 included,
// and decode(encode(x)) == x byte for byte (decode gives bytes: a <0xNN> token is its byte)
// where the normalizer keeps x as it is.
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
  /// Hugging Face's tokenizer.json of a BPE model: byte-level (a ByteLevel pre-tokenizer, alone
  /// or after Splits by any pattern data::SplitPattern reads) or SentencePiece-style
  /// (byte_fallback, an unknown token, Metaspace or a Replace/Prepend normalizer); normalizers NFC,
  /// NFD, NFKC, NFKD, Replace, Prepend, Strip; decoders ByteLevel, Metaspace, Replace,
  /// ByteFallback, Fuse, Strip; added tokens; a TemplateProcessing post-processor. Anything else
  /// (WordPiece, Unigram, a BertNormalizer, ...) raises, naming it.
  static Tokenizer from_hf_json(const std::string& path);
  /// tokenizer.json in dir, else vocab.json + merges.txt, else encoder.json + vocab.bpe; with
  /// tokenizer_config.json's bos_token and eos_token and generation_config.json's bos_token_id
  /// and eos_token_id where dir has them.
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
  /// The end-of-text token: generation_config.json's (its first eos_token_id) or
  /// tokenizer_config.json's eos_token where from_directory read one, else "<|endoftext|>"
  /// (GPT-2, Qwen), "<|end_of_text|>" (Llama 3), "</s>" (Llama 2, Mistral) or "<eos>" (Gemma).
  std::optional<int32_t> end_of_text() const;
  /// The beginning-of-text token, found the same way ("<|begin_of_text|>", "<s>", "<bos>").
  std::optional<int32_t> begin_of_text() const;
  /// Every id that ends generation: generation_config.json's eos_token_id list, else
  /// end_of_text().
  std::vector<int32_t> stop_ids() const;
  /// The pattern the pre-tokenizer splits by (the first, if several), or null (Metaspace only).
  const SplitPattern* split_pattern() const;

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  struct Impl;

 private:
  // tokenizer_config.json's bos/eos tokens and generation_config.json's ids, where dir has them.
  void read_special_token_files(const std::string& dir);
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace weave::data

#pragma once
// What a data::Tokenizer holds, for the files that load one (tokenizer.cpp reads GPT-2's files,
// tokenizer_json.cpp Hugging Face's tokenizer.json) and the model that merges
// (tokenizer_model.cpp).
#include "weave/data/text/text_pipeline.h"
#include "weave/data/text/tokenizer.h"

#include <nlohmann/json_fwd.hpp>

#include <array>
#include <functional>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace weave::data {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <class V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

struct Tokenizer::Impl {
  std::vector<std::string> token_bytes;  // id -> the bytes it decodes to
  std::vector<bool> has_id;
  // The model's tokens as the pieces it merges hold them -> id: bytes for a byte-level model,
  // the text itself (U+2581 for spaces) for a SentencePiece-style one.
  StringMap<int32_t> vocab;
  /// Byte-level BPE (GPT-2, Llama 3, Qwen): pieces start as one token per byte, tokens are
  /// written in GPT-2's byte alphabet. Otherwise (Llama 2, Mistral, Gemma): one token per
  /// character, a character outside the vocabulary as its bytes' <0xNN> tokens (byte_fallback)
  /// or as the unknown token.
  bool byte_level = true;
  std::array<int32_t, 256> byte_token{};  // each byte's token (byte-level, or <0xNN>)
  bool byte_fallback = false;
  int32_t unknown = -1;  // the unknown token's id, or -1
  bool fuse_unknown = false;
  struct Merge {
    int32_t rank, merged;
  };
  std::unordered_map<uint64_t, Merge> merges;  // (left id << 32 | right id) -> merge
  TextPipeline pipeline;
  DecoderSpec decoder;
  bool ignore_merges = false;  // a piece that is a token is that token (Llama 3)
  struct Added {
    std::string content;
    int32_t id;
    bool special;
  };
  std::vector<Added> added;            // in the file's order
  StringMap<size_t> added_by_content;  // content -> index in added
  // For each first byte, the lengths of the added tokens that start with it, longest first.
  std::array<std::vector<size_t>, 256> added_lengths;
  std::vector<int32_t> prefix, suffix;  // the post-processor's
  std::optional<int32_t> bos, eos;      // tokenizer_config.json / generation_config.json
  std::vector<int32_t> stop_ids;        // every end-of-sequence id generation_config gives
  /// The JSON text of tokenizer.json's parts as read, written back as they were (empty for
  /// GPT-2's files: written as GPT-2's byte-level BPE).
  std::string normalizer_json, pre_tokenizer_json, decoder_json, post_processor_json;

  /// The vocabulary: an object of token -> id (in GPT-2's byte alphabet when byte-level).
  void add_vocab(const nlohmann::json& tokens, const char* file);
  /// The next merge, in rank order; both sides and their concatenation must be tokens.
  void add_merge(std::string_view left, std::string_view right, const char* file);
  /// A token matched in the text before splitting (its content is raw text).
  void add_token(std::string content, int32_t id, bool special);
  /// The added token that starts text[i:], longest first, if any may match.
  const Added* added_at(std::string_view text, size_t i, bool allow_special) const;

  /// Applies the merges to one piece, lowest rank first and leftmost among equals.
  void bpe(std::string_view piece, std::vector<int32_t>& out) const;
  /// SentencePiece-style models merge within words: a merge can join a U+2581 (a word's start) to
  /// the character before it only where some token holds the two side by side. These are such
  /// characters (Gemma's ">" of ">▁</"); before any other, pieces are cut, so that BPE and its
  /// cache work word by word, as fast as byte-level models, with the same tokens.
  std::unordered_set<std::string, StringHash, std::equal_to<>> glued_to_word_start;
  void find_word_starts();
  std::vector<std::string_view> cut_at_word_starts(
      const std::vector<std::string_view>& pieces) const;
  /// Encodes one section of ordinary text (between added tokens); `at_start`: it starts the text.
  void encode_ordinary(std::string_view text, bool at_start, StringMap<std::vector<int32_t>>& cache,
                       std::vector<int32_t>& out) const;
  void set_token(int32_t id, std::string bytes, const char* file);
  /// The piece-space key of a token as the vocabulary file writes it.
  std::string key_of(std::string_view token, const char* file) const;
  /// A token's id as a file gives it: an integer in [0, kMaxTokenId], else raises, naming the
  /// file and the token.
  static int32_t id_from(const nlohmann::json& id, std::string_view token, const char* file);
  /// The largest id a tokenizer may hold: 2^24 - 1, 60 times the largest vocabularies shipped
  /// (a larger one is a damaged file, whose table would take gigabytes).
  static constexpr int64_t kMaxTokenId = (int64_t(1) << 24) - 1;
  /// A token's bytes in GPT-2's byte-to-character alphabet, as vocabulary files write them.
  static std::string bytes_to_alphabet(std::string_view bytes);
  /// A vocabulary key as tokenizer.json writes it.
  std::string file_text(std::string_view key) const {
    return byte_level ? bytes_to_alphabet(key) : std::string(key);
  }
};

}  // namespace weave::data

#pragma once
// What a data::Tokenizer holds, for the files that load one (tokenizer.cpp reads GPT-2's files,
// tokenizer_json.cpp Hugging Face's tokenizer.json).
#include "weave/data/text/tokenizer.h"

#include <nlohmann/json_fwd.hpp>

#include <array>
#include <functional>
#include <string>
#include <unordered_map>

namespace weave::data {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <class V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

struct Tokenizer::Impl {
  std::vector<std::string> token_bytes;  // id -> bytes
  std::vector<bool> has_id;
  StringMap<int32_t> vocab;  // the model's tokens, bytes -> id
  std::array<int32_t, 256> byte_token{};
  struct Merge {
    int32_t rank, merged;
  };
  std::unordered_map<uint64_t, Merge> merges;  // (left id << 32 | right id) -> merge
  SplitRule rule = SplitRule::kGpt2;
  bool add_prefix_space = false;
  bool ignore_merges = false;  // a piece that is a token is that token (Llama 3)
  struct Added {
    std::string content;
    int32_t id;
    bool special;
  };
  std::vector<Added> added;                  // longest first
  std::array<bool, 256> added_first_byte{};  // the bytes an added token can start with
  std::vector<int32_t> prefix, suffix;       // the post-processor's

  /// The vocabulary: an object of token -> id, tokens in GPT-2's byte-to-character alphabet.
  void add_vocab(const nlohmann::json& tokens, const char* file);
  /// The next merge, in rank order; both sides and their concatenation must be tokens.
  void add_merge(std::string_view left, std::string_view right, const char* file);
  /// A token matched in the text before splitting (its content is raw text).
  void add_token(std::string content, int32_t id, bool special);

  /// Applies the merges to one piece, lowest rank first and leftmost among equals.
  void bpe(std::string_view piece, std::vector<int32_t>& out) const;
  void encode_ordinary(std::string_view text, StringMap<std::vector<int32_t>>& cache,
                       std::vector<int32_t>& out) const;
  void set_token(int32_t id, std::string bytes, const char* file);
  /// A token's id as a file gives it: an integer in [0, kMaxTokenId], else raises, naming the
  /// file and the token.
  static int32_t id_from(const nlohmann::json& id, std::string_view token, const char* file);
  /// The largest id a tokenizer may hold: 2^24 - 1, 60 times the largest vocabularies shipped
  /// (a larger one is a damaged file, whose table would take gigabytes).
  static constexpr int64_t kMaxTokenId = (int64_t(1) << 24) - 1;
  /// A token's bytes in GPT-2's byte-to-character alphabet, as vocabulary files write them.
  static std::string bytes_to_alphabet(std::string_view bytes);
};

}  // namespace weave::data

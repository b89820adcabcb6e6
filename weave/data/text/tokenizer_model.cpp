// The model of a tokenizer: its vocabulary, merges and added tokens, and byte-pair encoding of
// each piece the text pipeline cuts.
#include "weave/data/text/tokenizer_impl.h"
#include "weave/data/text/unicode.h"
#include "weave/tensor/error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <queue>

namespace weave::data {
namespace {

using json = nlohmann::json;

// GPT-2's alphabet: the printable bytes stand for themselves, the other 68 for U+0100 on, so
// that every token is printable text in the vocabulary files.
std::array<uint32_t, 256> byte_to_code_point() {
  std::array<uint32_t, 256> code{};
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    code[b] = printable ? b : next++;
  }
  return code;
}

// A vocabulary entry's bytes: each UTF-8 character of `token` is one byte of the alphabet.
std::string alphabet_to_bytes(std::string_view token, const char* file) {
  static const auto byte_of = [] {
    std::array<int, 512> inverse;
    inverse.fill(-1);
    const auto code = byte_to_code_point();
    for (int b = 0; b < 256; ++b) inverse[code[size_t(b)]] = b;
    return inverse;
  }();
  std::string bytes;
  for (size_t i = 0; i < token.size();) {
    const auto lead = uint8_t(token[i]);
    uint32_t code = lead, size = 1;
    if (lead >= 0xC0 && lead < 0xE0 && i + 1 < token.size())
      code = ((lead & 0x1Fu) << 6) | (uint8_t(token[i + 1]) & 0x3Fu), size = 2;
    WEAVE_CHECK(lead < 0x80 || size == 2, "tokenizer",
                "{} token '{}' has a character outside the byte-level alphabet (U+0021 to "
                "U+0143); hint: only byte-level BPE vocabularies are supported",
                file, token);
    WEAVE_CHECK(code < 512 && byte_of[code] >= 0, "tokenizer",
                "{} token '{}' has U+{:04X}, which stands for no byte in the byte-level alphabet",
                file, token, code);
    bytes.push_back(char(byte_of[code]));
    i += size;
  }
  return bytes;
}

}  // namespace

std::string Tokenizer::Impl::bytes_to_alphabet(std::string_view bytes) {
  static const auto code = byte_to_code_point();
  std::string out;
  for (const char c : bytes) {
    const uint32_t cp = code[uint8_t(c)];
    if (cp < 0x80) {
      out.push_back(char(cp));
    } else {  // two UTF-8 bytes: every code point of the alphabet is below U+0800
      out.push_back(char(0xC0 | (cp >> 6)));
      out.push_back(char(0x80 | (cp & 0x3F)));
    }
  }
  return out;
}

namespace {

uint64_t pair_key(int32_t left, int32_t right) {
  return (uint64_t(uint32_t(left)) << 32) | uint32_t(right);
}

}  // namespace

int32_t Tokenizer::Impl::id_from(const json& id, std::string_view token, const char* file) {
  WEAVE_CHECK(id.is_number_integer(), "tokenizer", "{}: token '{}' has no integer id", file, token);
  const bool fits = id.is_number_unsigned()
                        ? id.get<uint64_t>() <= uint64_t(kMaxTokenId)
                        : id.get<int64_t>() >= 0 && id.get<int64_t>() <= kMaxTokenId;
  WEAVE_CHECK(fits, "tokenizer", "{} gives token '{}' the id {}, outside [0, {}]", file, token,
              id.dump(), kMaxTokenId);
  return id.get<int32_t>();
}

void Tokenizer::Impl::set_token(int32_t id, std::string bytes, const char* file) {
  WEAVE_CHECK(id >= 0 && id <= kMaxTokenId, "tokenizer",
              "{} gives token '{}' the id {}, outside [0, {}]", file, bytes, id, kMaxTokenId);
  if (size_t(id) >= token_bytes.size()) {
    token_bytes.resize(size_t(id) + 1);
    has_id.resize(size_t(id) + 1);
  }
  // Two tokens under one id could not both decode: decode(encode(x)) would lose one.
  WEAVE_CHECK(!has_id[size_t(id)] || token_bytes[size_t(id)] == bytes, "tokenizer",
              "{} gives the id {} to two tokens, '{}' and '{}'", file, id,
              bytes_to_alphabet(token_bytes[size_t(id)]), bytes_to_alphabet(bytes));
  token_bytes[size_t(id)] = std::move(bytes);
  has_id[size_t(id)] = true;
}

std::string Tokenizer::Impl::key_of(std::string_view token, const char* file) const {
  return byte_level ? alphabet_to_bytes(token, file) : std::string(token);
}

namespace {

// The byte a SentencePiece byte token (<0x41>) stands for, or -1.
int byte_token_value(std::string_view token) {
  if (token.size() != 6 || !token.starts_with("<0x") || token[5] != '>') return -1;
  int value = 0;
  for (const char c : token.substr(3, 2)) {
    if (!std::isxdigit(uint8_t(c))) return -1;
    value = value * 16 + (c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
  }
  return value;
}

}  // namespace

void Tokenizer::Impl::add_vocab(const json& tokens, const char* file) {
  WEAVE_CHECK(tokens.is_object() && !tokens.empty(), "tokenizer",
              "{}: expected an object of token -> id, found {}", file, tokens.type_name());
  byte_token.fill(-1);
  for (const auto& [token, id] : tokens.items()) {
    const int32_t number = id_from(id, token, file);
    std::string key = key_of(token, file);
    std::string bytes = key;
    if (!byte_level) {  // what the decoder makes of it: <0xNN> its byte, the rest replaced
      const int byte = byte_token_value(token);
      if (byte >= 0 && byte_fallback) byte_token[size_t(byte)] = number;
      if (byte >= 0 && decoder.byte_fallback)
        bytes = std::string(1, char(byte));
      else
        for (const auto& [from, to] : decoder.replace) replace_all(bytes, from, to);
    }
    vocab.emplace(std::move(key), number);
    set_token(number, std::move(bytes), file);
  }
  if (!byte_level && !byte_fallback) return;
  for (int b = 0; b < 256; ++b) {
    if (byte_level)
      if (const auto found = vocab.find(std::string(1, char(b))); found != vocab.end())
        byte_token[size_t(b)] = found->second;
    WEAVE_CHECK(byte_token[size_t(b)] >= 0, "tokenizer",
                "{} has no token for byte 0x{:02X}; hint: a byte-level BPE vocabulary (or one "
                "with byte_fallback: <0x{:02X}>) has one for each of the 256",
                file, b, b);
  }
}

void Tokenizer::Impl::add_merge(std::string_view left, std::string_view right, const char* file) {
  const std::string l = key_of(left, file), r = key_of(right, file);
  const auto a = vocab.find(l), b = vocab.find(r), ab = vocab.find(l + r);
  WEAVE_CHECK(a != vocab.end() && b != vocab.end() && ab != vocab.end(), "tokenizer",
              "{}: merge '{} {}' (rank {}) names a token missing from the vocabulary", file, left,
              right, merges.size());
  merges.emplace(pair_key(a->second, b->second), Merge{int32_t(merges.size()), ab->second});
}

void Tokenizer::Impl::add_token(std::string content, int32_t id, bool special) {
  WEAVE_CHECK(!content.empty(), "tokenizer", "added token {} has no content", id);
  // An added token decodes as the decoder makes of its text (Gemma's "▁▁" is two spaces).
  std::string bytes = content;
  if (!byte_level)
    for (const auto& [from, to] : decoder.replace) replace_all(bytes, from, to);
  set_token(id, std::move(bytes), "added tokens");
  std::vector<size_t>& lengths = added_lengths[uint8_t(content[0])];
  if (std::find(lengths.begin(), lengths.end(), content.size()) == lengths.end()) {
    lengths.push_back(content.size());
    std::sort(lengths.begin(), lengths.end(), std::greater<>());
  }
  added_by_content[content] = added.size();
  added.push_back({std::move(content), id, special});
}

const Tokenizer::Impl::Added* Tokenizer::Impl::added_at(std::string_view text, size_t i,
                                                        bool allow_special) const {
  for (const size_t length : added_lengths[uint8_t(text[i])]) {
    if (i + length > text.size()) continue;
    const auto found = added_by_content.find(text.substr(i, length));
    if (found == added_by_content.end()) continue;
    const Added& token = added[found->second];
    if (allow_special || !token.special) return &token;
  }
  return nullptr;
}

namespace {

// The first symbols of a piece: its bytes' tokens (byte-level), or its characters' tokens, a
// character outside the vocabulary as its bytes' <0xNN> tokens or as the unknown token.
std::vector<int32_t> first_symbols(const Tokenizer::Impl& impl, std::string_view piece) {
  std::vector<int32_t> symbols;
  symbols.reserve(piece.size());
  if (impl.byte_level) {
    for (const char c : piece) symbols.push_back(impl.byte_token[uint8_t(c)]);
    return symbols;
  }
  bool previous_unknown = false;
  for (size_t i = 0; i < piece.size();) {
    const size_t size = unicode::char_at(piece, i).size;
    const auto found = impl.vocab.find(piece.substr(i, size));
    if (found != impl.vocab.end()) {
      symbols.push_back(found->second);
    } else if (impl.byte_fallback) {
      for (size_t k = i; k < i + size; ++k) symbols.push_back(impl.byte_token[uint8_t(piece[k])]);
    } else {
      WEAVE_CHECK(impl.unknown >= 0, "tokenizer",
                  "'{}' has no token and the tokenizer has neither byte_fallback nor an unknown "
                  "token",
                  piece.substr(i, size));
      if (!(impl.fuse_unknown && previous_unknown)) symbols.push_back(impl.unknown);
    }
    previous_unknown = found == impl.vocab.end() && !impl.byte_fallback;
    i += size;
  }
  return symbols;
}

}  // namespace

void Tokenizer::Impl::bpe(std::string_view piece, std::vector<int32_t>& out) const {
  std::vector<int32_t> symbols = first_symbols(*this, piece);
  if (symbols.size() <= 32) {  // short pieces: the pairs' merges in an array, scanned each round
    constexpr Merge kNone{INT32_MAX, -1};
    const auto merge_at = [&](size_t i) {
      const auto found = merges.find(pair_key(symbols[i], symbols[i + 1]));
      return found == merges.end() ? kNone : found->second;
    };
    std::array<Merge, 32> pair_merges;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) pair_merges[i] = merge_at(i);
    const auto by_rank = [](const Merge& x, const Merge& y) { return x.rank < y.rank; };
    while (symbols.size() > 1) {
      const size_t pairs = symbols.size() - 1;
      const size_t at =
          size_t(std::min_element(pair_merges.begin(), pair_merges.begin() + pairs, by_rank) -
                 pair_merges.begin());
      if (pair_merges[at].rank == kNone.rank) break;
      symbols[at] = pair_merges[at].merged;
      symbols.erase(symbols.begin() + std::ptrdiff_t(at) + 1);
      std::copy(pair_merges.begin() + std::ptrdiff_t(at) + 1,
                pair_merges.begin() + std::ptrdiff_t(pairs),
                pair_merges.begin() + std::ptrdiff_t(at));
      if (at > 0) pair_merges[at - 1] = merge_at(at - 1);
      if (at + 1 < symbols.size()) pair_merges[at] = merge_at(at);
    }
    out.insert(out.end(), symbols.begin(), symbols.end());
    return;
  }
  // Long pieces (runs of spaces or symbols): a linked list and a queue of candidate pairs
  // ordered by (rank, position); entries that merges have outdated are skipped when popped.
  const size_t n = symbols.size();
  std::vector<size_t> next(n), prev(n);
  for (size_t i = 0; i < n; ++i) next[i] = i + 1, prev[i] = i - 1;
  using Candidate =
      std::tuple<int32_t, size_t, int32_t, int32_t, int32_t>;  // rank, left, ids, merged
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  const auto offer = [&](size_t left) {
    if (left >= n || next[left] >= n) return;
    const auto found = merges.find(pair_key(symbols[left], symbols[next[left]]));
    if (found != merges.end())
      queue.emplace(found->second.rank, left, symbols[left], symbols[next[left]],
                    found->second.merged);
  };
  for (size_t i = 0; i + 1 < n; ++i) offer(i);
  while (!queue.empty()) {
    const auto [rank, left, a, b, merged] = queue.top();
    queue.pop();
    const size_t right = next[left];
    if (symbols[left] != a || right >= n || symbols[right] != b) continue;  // outdated
    symbols[left] = merged;
    symbols[right] = -1;
    next[left] = next[right];
    if (next[left] < n) prev[next[left]] = left;
    if (left > 0 && prev[left] < n) offer(prev[left]);
    offer(left);
  }
  for (size_t i = 0; i < n; i = next[i]) out.push_back(symbols[i]);
}

void Tokenizer::Impl::find_word_starts() {
  constexpr std::string_view kMark = "\u2581";
  glued_to_word_start.clear();
  for (const auto& [key, id] : vocab)
    for (size_t at = key.find(kMark, 1); at != std::string::npos; at = key.find(kMark, at + 1)) {
      size_t before = at - 1;  // back to the first byte of the character before the mark
      while (before > 0 && (uint8_t(key[before]) & 0xC0) == 0x80) --before;
      const std::string glued = key.substr(before, at - before);
      if (glued != kMark) glued_to_word_start.insert(glued);
    }
}

std::vector<std::string_view> Tokenizer::Impl::cut_at_word_starts(
    const std::vector<std::string_view>& pieces) const {
  constexpr std::string_view kMark = "\u2581";
  std::vector<std::string_view> out;
  out.reserve(pieces.size());
  for (std::string_view piece : pieces) {
    size_t start = 0, previous = 0;  // previous: where the character before `at` starts
    for (size_t at = 0; at < piece.size();) {
      const size_t size = unicode::char_at(piece, at).size;
      if (at > start && piece.substr(at).starts_with(kMark)) {
        const std::string_view before = piece.substr(previous, at - previous);
        if (before != kMark && !glued_to_word_start.contains(before)) {
          out.push_back(piece.substr(start, at - start));
          start = at;
        }
      }
      previous = at;
      at += size;
    }
    out.push_back(piece.substr(start));
  }
  return out;
}

void Tokenizer::Impl::encode_ordinary(std::string_view text, bool at_start,
                                      StringMap<std::vector<int32_t>>& cache,
                                      std::vector<int32_t>& out) const {
  if (text.empty()) return;
  std::string storage;
  std::vector<std::string_view> pieces;
  pipeline.pieces(text, at_start, storage, pieces);
  if (!byte_level) pieces = cut_at_word_starts(pieces);
  for (std::string_view piece : pieces) {
    if (ignore_merges)
      if (const auto whole = vocab.find(piece); whole != vocab.end()) {
        out.push_back(whole->second);
        continue;
      }
    if (const auto hit = cache.find(piece); hit != cache.end()) {
      out.insert(out.end(), hit->second.begin(), hit->second.end());
      continue;
    }
    const size_t first = out.size();
    bpe(piece, out);
    if (piece.size() <= 64 && cache.size() < (size_t(1) << 18))
      cache.emplace(std::string(piece),
                    std::vector<int32_t>(out.begin() + std::ptrdiff_t(first), out.end()));
  }
}

}  // namespace weave::data

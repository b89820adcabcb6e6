#include "weave/data/text/tokenizer.h"

#include "weave/data/text/tokenizer_impl.h"

#include "weave/data/files.h"
#include "weave/tensor/error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <filesystem>
#include <queue>
#include <system_error>
#include <thread>
#include <unordered_map>

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

void Tokenizer::Impl::add_vocab(const json& tokens, const char* file) {
  WEAVE_CHECK(tokens.is_object() && !tokens.empty(), "tokenizer",
              "{}: expected an object of token -> id, found {}", file, tokens.type_name());
  for (const auto& [token, id] : tokens.items()) {
    const int32_t number = id_from(id, token, file);
    std::string bytes = alphabet_to_bytes(token, file);
    vocab.emplace(bytes, number);
    set_token(number, std::move(bytes), file);
  }
  for (int b = 0; b < 256; ++b) {
    const auto found = vocab.find(std::string(1, char(b)));
    WEAVE_CHECK(found != vocab.end(), "tokenizer",
                "{} has no token for byte 0x{:02X}; hint: a byte-level BPE vocabulary has one "
                "for each of the 256",
                file, b);
    byte_token[size_t(b)] = found->second;
  }
}

void Tokenizer::Impl::add_merge(std::string_view left, std::string_view right, const char* file) {
  const std::string l = alphabet_to_bytes(left, file), r = alphabet_to_bytes(right, file);
  const auto a = vocab.find(l), b = vocab.find(r), ab = vocab.find(l + r);
  WEAVE_CHECK(a != vocab.end() && b != vocab.end() && ab != vocab.end(), "tokenizer",
              "{}: merge '{} {}' (rank {}) names a token missing from the vocabulary", file, left,
              right, merges.size());
  merges.emplace(pair_key(a->second, b->second), Merge{int32_t(merges.size()), ab->second});
}

void Tokenizer::Impl::add_token(std::string content, int32_t id, bool special) {
  WEAVE_CHECK(!content.empty(), "tokenizer", "added token {} has no content", id);
  set_token(id, content, "added tokens");
  added_first_byte[uint8_t(content[0])] = true;
  added.push_back({std::move(content), id, special});
  std::stable_sort(added.begin(), added.end(), [](const Added& x, const Added& y) {
    return x.content.size() > y.content.size();
  });
}

void Tokenizer::Impl::bpe(std::string_view piece, std::vector<int32_t>& out) const {
  std::vector<int32_t> symbols(piece.size());
  for (size_t i = 0; i < piece.size(); ++i) symbols[i] = byte_token[uint8_t(piece[i])];
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

void Tokenizer::Impl::encode_ordinary(std::string_view text, StringMap<std::vector<int32_t>>& cache,
                                      std::vector<int32_t>& out) const {
  std::string prefixed;
  if (add_prefix_space && !text.empty() && text[0] != ' ') {
    prefixed.push_back(' ');
    prefixed.append(text);
    text = prefixed;
  }
  std::vector<std::string_view> pieces;
  split_pieces(text, rule, pieces);
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

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

namespace {
using Cache = StringMap<std::vector<int32_t>>;

void encode_into(const Tokenizer::Impl& impl, std::string_view text, const EncodeOptions& options,
                 Cache& cache, std::vector<int32_t>& out) {
  if (options.add_special_tokens) out.insert(out.end(), impl.prefix.begin(), impl.prefix.end());
  // Added tokens cut the text; the ordinary text between them is split and merged.
  size_t start = 0;
  for (size_t i = 0; i < text.size();) {
    const Tokenizer::Impl::Added* match = nullptr;
    if (!impl.added_first_byte[uint8_t(text[i])]) {
      ++i;
      continue;
    }
    for (const auto& token : impl.added)
      if ((options.allow_special || !token.special) && text.substr(i).starts_with(token.content)) {
        match = &token;
        break;
      }
    if (!match) {
      ++i;
      continue;
    }
    impl.encode_ordinary(text.substr(start, i - start), cache, out);
    out.push_back(match->id);
    i += match->content.size();
    start = i;
  }
  impl.encode_ordinary(text.substr(start), cache, out);
  if (options.add_special_tokens) out.insert(out.end(), impl.suffix.begin(), impl.suffix.end());
}
}  // namespace

std::vector<int32_t> Tokenizer::encode(std::string_view text, const EncodeOptions& options) const {
  Cache cache;
  std::vector<int32_t> out;
  out.reserve(text.size() / 3);
  encode_into(*impl_, text, options, cache, out);
  return out;
}

std::vector<std::vector<int32_t>> Tokenizer::encode_batch(const std::vector<std::string>& texts,
                                                          const EncodeOptions& options,
                                                          int threads) const {
  constexpr int kMaxThreads = 1024;
  WEAVE_CHECK(threads >= 0 && threads <= kMaxThreads, "tokenizer",
              "threads must be in [0, {}] (0: the hardware's count), found {}; hint: one per core",
              kMaxThreads, threads);
  std::vector<std::vector<int32_t>> out(texts.size());
  const size_t workers = std::min<size_t>(
      texts.size(),
      threads > 0 ? size_t(threads) : std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::exception_ptr> errors(workers);
  const auto work = [&](size_t w) {
    try {
      Cache cache;
      for (size_t i = w; i < texts.size(); i += workers)
        encode_into(*impl_, texts[i], options, cache, out[i]);
    } catch (...) {
      errors[w] = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  try {
    for (size_t w = 1; w < workers; ++w) pool.emplace_back(work, w);
  } catch (const std::system_error& e) {
    // The threads made so far must be joined before they are destroyed (else: terminate).
    const size_t started = pool.size() + 1;
    for (auto& t : pool) t.join();
    WEAVE_FAIL("tokenizer",
               "could not start encoding thread {} of {} ({}); hint: fewer threads (one per core)",
               started + 1, workers, e.what());
  }
  if (workers > 0) work(0);
  for (auto& t : pool) t.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string text;
  for (int32_t id : ids) {
    WEAVE_CHECK(id >= 0 && size_t(id) < impl_->token_bytes.size() && impl_->has_id[size_t(id)],
                "tokenizer", "token id {} is outside the vocabulary (ids 0 to {})", id,
                impl_->token_bytes.size() - 1);
    text += impl_->token_bytes[size_t(id)];
  }
  return text;
}

int64_t Tokenizer::vocab_size() const {
  return int64_t(impl_->token_bytes.size());
}

std::optional<int32_t> Tokenizer::token_id(std::string_view text) const {
  for (const auto& token : impl_->added)
    if (token.content == text) return token.id;
  if (const auto found = impl_->vocab.find(text); found != impl_->vocab.end()) return found->second;
  return std::nullopt;
}

std::optional<int32_t> Tokenizer::end_of_text() const {
  if (auto id = token_id("<|endoftext|>")) return id;
  return token_id("<|end_of_text|>");
}

SplitRule Tokenizer::split_rule() const {
  return impl_->rule;
}

Tokenizer Tokenizer::from_gpt2_files(const std::string& encoder_json,
                                     const std::string& vocab_bpe) {
  auto impl = std::make_unique<Impl>();
  json tokens;
  try {
    tokens = json::parse(read_file(encoder_json));
  } catch (const json::exception& e) {
    WEAVE_FAIL("tokenizer", "{} is not valid JSON: {}", encoder_json, e.what());
  }
  impl->add_vocab(tokens, "encoder.json");
  const std::string merges = read_file(vocab_bpe);
  size_t line_start = 0;
  for (size_t line = 0; line_start < merges.size(); ++line) {
    size_t end = merges.find('\n', line_start);
    if (end == std::string::npos) end = merges.size();
    std::string_view text(merges.data() + line_start, end - line_start);
    line_start = end + 1;
    if (!text.empty() && text.back() == '\r') text.remove_suffix(1);
    if (text.empty() || text.starts_with("#version")) continue;
    const size_t space = text.find(' ');
    WEAVE_CHECK(space != std::string_view::npos && space > 0 && space + 1 < text.size(),
                "tokenizer", "{} line {}: expected 'left right', found '{}'", vocab_bpe, line + 1,
                text);
    impl->add_merge(text.substr(0, space), text.substr(space + 1), "vocab.bpe");
  }
  // GPT-2 names its one special token in the vocabulary itself.
  if (const auto eot = impl->vocab.find(std::string_view("<|endoftext|>"));
      eot != impl->vocab.end())
    impl->add_token("<|endoftext|>", eot->second, true);
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_directory(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path d(dir);
  if (fs::exists(d / "tokenizer.json")) return from_hf_json((d / "tokenizer.json").string());
  if (fs::exists(d / "vocab.json") && fs::exists(d / "merges.txt"))
    return from_gpt2_files((d / "vocab.json").string(), (d / "merges.txt").string());
  if (fs::exists(d / "encoder.json") && fs::exists(d / "vocab.bpe"))
    return from_gpt2_files((d / "encoder.json").string(), (d / "vocab.bpe").string());
  WEAVE_FAIL("tokenizer",
             "{} has no tokenizer: expected tokenizer.json, vocab.json + merges.txt, or "
             "encoder.json + vocab.bpe",
             dir);
}

}  // namespace weave::data

#include "weave/data/text/tokenizer.h"

#include "weave/data/text/tokenizer_impl.h"

#include "weave/data/files.h"
#include "weave/tensor/error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <filesystem>
#include <system_error>
#include <thread>
#include <unordered_map>

namespace weave::data {
namespace {
using json = nlohmann::json;
}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

namespace {
using Cache = StringMap<std::vector<int32_t>>;

void encode_into(const Tokenizer::Impl& impl, std::string_view text, const EncodeOptions& options,
                 Cache& cache, std::vector<int32_t>& out) {
  if (options.add_special_tokens) out.insert(out.end(), impl.prefix.begin(), impl.prefix.end());
  // Added tokens cut the text; the ordinary text between them is normalized, split and merged.
  size_t start = 0;
  for (size_t i = 0; i < text.size();) {
    const Tokenizer::Impl::Added* match = impl.added_at(text, i, options.allow_special);
    if (!match) {
      ++i;
      continue;
    }
    impl.encode_ordinary(text.substr(start, i - start), start == 0, cache, out);
    out.push_back(match->id);
    i += match->content.size();
    start = i;
  }
  impl.encode_ordinary(text.substr(start), start == 0, cache, out);
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
  // The decoder's Strip (or Metaspace's first space): spaces its prefix added, off the ends.
  size_t begin = 0, end = text.size();
  for (size_t k = 0; k < impl_->decoder.strip_start && begin < end && text[begin] == ' '; ++k)
    ++begin;
  for (size_t k = 0; k < impl_->decoder.strip_stop && end > begin && text[end - 1] == ' '; ++k)
    --end;
  return begin == 0 && end == text.size() ? text : text.substr(begin, end - begin);
}

int64_t Tokenizer::vocab_size() const {
  return int64_t(impl_->token_bytes.size());
}

std::optional<int32_t> Tokenizer::token_id(std::string_view text) const {
  if (const auto found = impl_->added_by_content.find(text); found != impl_->added_by_content.end())
    return impl_->added[found->second].id;
  if (const auto found = impl_->vocab.find(text); found != impl_->vocab.end()) return found->second;
  return std::nullopt;
}

std::optional<int32_t> Tokenizer::end_of_text() const {
  if (impl_->eos) return impl_->eos;
  for (const char* name : {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"})
    if (auto id = token_id(name)) return id;
  return std::nullopt;
}

std::optional<int32_t> Tokenizer::begin_of_text() const {
  if (impl_->bos) return impl_->bos;
  for (const char* name : {"<|begin_of_text|>", "<s>", "<bos>"})
    if (auto id = token_id(name)) return id;
  return std::nullopt;
}

std::vector<int32_t> Tokenizer::stop_ids() const {
  if (!impl_->stop_ids.empty()) return impl_->stop_ids;
  if (const auto eos = end_of_text()) return {*eos};
  return {};
}

const SplitPattern* Tokenizer::split_pattern() const {
  for (const PreTokenizerStep& step : impl_->pipeline.pre_tokenizers)
    if (step.pattern) return &*step.pattern;
  return nullptr;
}

Tokenizer Tokenizer::from_gpt2_files(const std::string& encoder_json,
                                     const std::string& vocab_bpe) {
  auto impl = std::make_unique<Impl>();
  PreTokenizerStep byte_level(PreTokenizerStep::kByteLevel);
  byte_level.pattern = SplitPattern::gpt2();
  impl->pipeline.pre_tokenizers.push_back(std::move(byte_level));
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
  const auto with_special_tokens = [&](Tokenizer tok) {
    tok.read_special_token_files(dir);
    return tok;
  };
  if (fs::exists(d / "tokenizer.json"))
    return with_special_tokens(from_hf_json((d / "tokenizer.json").string()));
  if (fs::exists(d / "vocab.json") && fs::exists(d / "merges.txt"))
    return with_special_tokens(
        from_gpt2_files((d / "vocab.json").string(), (d / "merges.txt").string()));
  if (fs::exists(d / "encoder.json") && fs::exists(d / "vocab.bpe"))
    return from_gpt2_files((d / "encoder.json").string(), (d / "vocab.bpe").string());
  WEAVE_FAIL("tokenizer",
             "{} has no tokenizer: expected tokenizer.json, vocab.json + merges.txt, or "
             "encoder.json + vocab.bpe",
             dir);
}

}  // namespace weave::data

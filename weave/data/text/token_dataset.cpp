#include "weave/data/text/token_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "weave/data/files.h"

namespace weave::data {
namespace {

constexpr char kMagic[8] = {'w', 'e', 'a', 'v', 'e', 't', 'o', 'k'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 64;

// The header, little-endian as the machines weave runs on.
struct Header {
  char magic[8];
  uint32_t version, token_bytes;
  uint64_t tokens, documents;
  int64_t vocab_size, end_of_text;
  uint64_t index_offset;
  unsigned char reserved[8];
};
static_assert(sizeof(Header) == kHeaderBytes);

// Where the index starts: after the tokens, padded to 8 bytes (the index is read in place).
uint64_t index_offset(uint64_t tokens, uint64_t token_bytes) {
  return (kHeaderBytes + tokens * token_bytes + 7) / 8 * 8;
}

}  // namespace

std::vector<std::string> split_documents(const std::string& text, const std::string& separator) {
  if (separator.empty()) return text.empty() ? std::vector<std::string>{} : std::vector{text};
  std::vector<std::string> documents(1);
  for (size_t start = 0; start < text.size();) {
    size_t end = text.find('\n', start);
    end = end == std::string::npos ? text.size() : end + 1;
    std::string_view line(text.data() + start, end - start);
    if (line.ends_with('\n')) line.remove_suffix(1);
    if (line == separator)
      documents.emplace_back();
    else
      documents.back().append(text, start, end - start);
    start = end;
  }
  std::erase_if(documents, [](const std::string& d) { return d.empty(); });
  return documents;
}

TokenFileWriter::TokenFileWriter(std::string path, TokenFileOptions options)
    : path_(std::move(path)), options_(options) {
  WEAVE_CHECK(options_.vocab_size > 0 && options_.vocab_size <= (int64_t(1) << 32), "TokenFile",
              "vocab_size {} must be in [1, 2^32]", options_.vocab_size);
  WEAVE_CHECK(options_.end_of_text < options_.vocab_size, "TokenFile",
              "end_of_text {} is outside the vocabulary of {}", options_.end_of_text,
              options_.vocab_size);
  out_ = std::make_unique<AtomicFileWriter>(path_);
  const std::vector<unsigned char> zeros(kHeaderBytes, 0);  // the header, written by finish()
  out_->write(zeros.data(), zeros.size());
}

TokenFileWriter::~TokenFileWriter() = default;  // not finished: the temporary file goes

void TokenFileWriter::append_document(std::span<const int32_t> tokens) {
  WEAVE_CHECK(out_ != nullptr, "TokenFile", "{} is already finished", path_);
  const bool wide = options_.vocab_size > 65536;
  buffer_.clear();
  const auto put = [&](int64_t token) {
    WEAVE_CHECK(token >= 0 && token < options_.vocab_size, "TokenFile",
                "token {} of document {} is outside the vocabulary of {}", token, starts_.size(),
                options_.vocab_size);
    const auto value = uint32_t(token);
    for (int b = 0; b < (wide ? 4 : 2); ++b) buffer_.push_back((unsigned char)(value >> (8 * b)));
  };
  for (int32_t token : tokens) put(token);
  if (options_.end_of_text >= 0) put(options_.end_of_text);
  starts_.push_back(written_);
  written_ += buffer_.size() / (wide ? 4 : 2);
  out_->write(buffer_.data(), buffer_.size());
}

void TokenFileWriter::finish() {
  WEAVE_CHECK(out_ != nullptr, "TokenFile", "{} is already finished", path_);
  Header header{};
  std::memcpy(header.magic, kMagic, sizeof kMagic);
  header.version = kVersion;
  header.token_bytes = options_.vocab_size > 65536 ? 4 : 2;
  header.tokens = written_;
  header.documents = starts_.size();
  header.vocab_size = options_.vocab_size;
  header.end_of_text = options_.end_of_text;
  header.index_offset = index_offset(written_, header.token_bytes);
  const std::vector<unsigned char> padding(
      header.index_offset - (kHeaderBytes + written_ * header.token_bytes), 0);
  out_->write(padding.data(), padding.size());
  std::vector<uint64_t> index = starts_;
  index.push_back(written_);
  out_->write(index.data(), index.size() * sizeof(uint64_t));
  out_->write_at(&header, sizeof header, 0);
  out_->commit();
  out_.reset();
}

TokenizeStats write_token_file(const std::string& out, const std::vector<std::string>& files,
                               const Tokenizer& tokenizer, const TokenizeOptions& options) {
  const std::optional<int32_t> end = tokenizer.end_of_text();
  WEAVE_CHECK(!options.end_of_text || end, "TokenFile",
              "the tokenizer has no end-of-text token to end each document with; hint: "
              "end_of_text = false");
  for (const std::string& file : files) {  // the output would replace its own input
    std::error_code ignored;
    WEAVE_CHECK(!std::filesystem::equivalent(file, out, ignored), "TokenFile",
                "the output {} is also an input ({}); hint: write the tokens to another file", out,
                file);
  }
  TokenFileWriter writer(
      out, {.vocab_size = tokenizer.vocab_size(), .end_of_text = options.end_of_text ? *end : -1});
  TokenizeStats stats;
  for (size_t next = 0; next < files.size();) {
    std::vector<std::string> documents;
    const uint64_t batch_start = stats.bytes;
    for (; next < files.size() && stats.bytes - batch_start < (uint64_t(16) << 20); ++next) {
      const std::string text = read_file(files[next]);
      stats.bytes += text.size();
      for (auto& d : split_documents(text, options.separator)) documents.push_back(std::move(d));
    }
    for (const auto& ids : tokenizer.encode_batch(documents, {}, options.threads))
      writer.append_document(ids);
    if (options.on_progress) options.on_progress(stats.bytes);
  }
  writer.finish();
  stats.documents = writer.documents(), stats.tokens = writer.tokens();
  return stats;
}

TokenFile::TokenFile(const std::string& path) : path_(path) {
  ReadOnlyFile file(path);
  struct stat st {};
  if (::fstat(file.fd, &st) != 0) fail_io("stat", path);
  map_size_ = size_t(st.st_size);
  WEAVE_CHECK(map_size_ >= kHeaderBytes, "TokenFile",
              "{} holds {} bytes, less than a token file's header; hint: write token files with "
              "weave-tokenize",
              path, map_size_);
  void* map = ::mmap(nullptr, map_size_, PROT_READ, MAP_SHARED, file.fd, 0);
  if (map == MAP_FAILED) fail_io("map", path);
  map_ = static_cast<const unsigned char*>(map);
  Header h;
  std::memcpy(&h, map_, sizeof h);
  const auto fail_unless = [&](bool ok, const std::string& what) {
    if (ok) return;
    ::munmap(const_cast<unsigned char*>(map_), map_size_);
    map_ = nullptr;
    WEAVE_FAIL("TokenFile", "{} is not a valid token file: {}", path, what);
  };
  fail_unless(std::memcmp(h.magic, kMagic, sizeof kMagic) == 0, "its magic is not 'weavetok'");
  fail_unless(h.version == kVersion, fmt::format("version {} (expected {})", h.version, kVersion));
  fail_unless(h.token_bytes == 2 || h.token_bytes == 4,
              fmt::format("{} bytes a token", h.token_bytes));
  fail_unless(
      h.tokens < (uint64_t(1) << 48) && h.documents <= h.tokens &&
          h.index_offset == index_offset(h.tokens, h.token_bytes) &&
          map_size_ == h.index_offset + (h.documents + 1) * sizeof(uint64_t),
      fmt::format("{} tokens and {} documents need {} bytes, the file has {} (truncated?)",
                  h.tokens, h.documents,
                  index_offset(h.tokens, h.token_bytes) + (h.documents + 1) * 8, map_size_));
  tokens_ = h.tokens, documents_ = h.documents, token_bytes_ = int(h.token_bytes);
  vocab_size_ = h.vocab_size, end_of_text_ = h.end_of_text;
  token_data_ = map_ + kHeaderBytes;
  starts_ = reinterpret_cast<const uint64_t*>(map_ + h.index_offset);
  fail_unless(documents_ == 0 || starts_[0] == 0, "the first document does not start at 0");
  fail_unless(starts_[documents_] == tokens_, "the index does not end at the token count");
  fail_unless(std::is_sorted(starts_, starts_ + documents_ + 1), "document starts out of order");
  fail_unless(vocab_size_ > 0 && vocab_size_ <= (int64_t(1) << 32) && end_of_text_ < vocab_size_,
              fmt::format("vocabulary size {} with end-of-text {}", vocab_size_, end_of_text_));
  // Every token in the vocabulary (one pass): a bad id raises here, naming where it is, and
  // not later in an embedding that knows no file.
  const int64_t bad = first_outside_vocabulary();
  fail_unless(bad < 0, bad < 0 ? std::string()
                               : fmt::format("token {} is {}, outside its vocabulary of {}", bad,
                                             token_at(bad), vocab_size_));
}

int64_t TokenFile::token_at(int64_t i) const {
  int64_t value = 0;
  read(i, 1, &value);
  return value;
}

int64_t TokenFile::first_outside_vocabulary() const {
  // The largest token first (a loop the compiler vectorizes), the position only if it is bad.
  uint32_t largest = 0;
  if (token_bytes_ == 2) {
    const auto* p = token_data_;
    for (uint64_t i = 0; i < tokens_; ++i)
      largest = std::max<uint32_t>(largest, uint32_t(p[2 * i]) | (uint32_t(p[2 * i + 1]) << 8));
  } else {
    for (uint64_t i = 0; i < tokens_; ++i) {
      uint32_t v;
      std::memcpy(&v, token_data_ + 4 * i, 4);
      largest = std::max(largest, v);
    }
  }
  if (int64_t(largest) < vocab_size_) return -1;
  for (int64_t i = 0; i < size(); ++i)
    if (token_at(i) >= vocab_size_) return i;
  return -1;
}

TokenFile::~TokenFile() {
  if (map_) ::munmap(const_cast<unsigned char*>(map_), map_size_);
}

void TokenFile::read(int64_t start, int64_t count, int64_t* out) const {
  WEAVE_CHECK(start >= 0 && count >= 0 && start + count <= size(), "TokenFile",
              "tokens [{}, {}) are outside {}'s {}", start, start + count, path_, size());
  if (token_bytes_ == 2) {
    const auto* p = token_data_ + 2 * start;
    for (int64_t i = 0; i < count; ++i) out[i] = int64_t(p[2 * i]) | (int64_t(p[2 * i + 1]) << 8);
    return;
  }
  for (int64_t i = 0; i < count; ++i) {
    uint32_t v;
    std::memcpy(&v, token_data_ + 4 * (start + i), 4);
    out[i] = int64_t(v);
  }
}

int64_t TokenFile::document_of(int64_t i) const {
  WEAVE_CHECK(i >= 0 && i < size(), "TokenFile", "token {} is outside {}'s {}", i, path_, size());
  return int64_t(std::upper_bound(starts_, starts_ + documents_, uint64_t(i)) - starts_) - 1;
}

int64_t TokenFile::document_start(int64_t document) const {
  WEAVE_CHECK(document >= 0 && document <= documents(), "TokenFile",
              "document {} is outside {}'s {}", document, path_, documents());
  return int64_t(starts_[document]);
}

TokenDataset::TokenDataset(std::shared_ptr<const TokenFile> file, TokenWindows windows)
    : file_(std::move(file)), windows_(windows) {
  WEAVE_CHECK(file_ != nullptr && windows_.context > 0, "TokenDataset",
              "needs a token file and a positive context, found context {}", windows_.context);
  const int64_t available = std::max<int64_t>(0, (file_->size() - 1) / windows_.context);
  last_ = windows_.last < 0 ? available : windows_.last;
  WEAVE_CHECK(windows_.first >= 0 && windows_.first < last_ && last_ <= available, "TokenDataset",
              "windows [{}, {}) of context {} are not within the {} that {}'s {} tokens hold",
              windows_.first, windows_.last, windows_.context, available, file_->path(),
              file_->size());
}

void TokenDataset::fill(int64_t index, int64_t* tokens, int64_t* positions,
                        int64_t* documents) const {
  WEAVE_CHECK(index >= 0 && index < size(), "TokenDataset", "window {} is outside [0, {})", index,
              size());
  const int64_t context = windows_.context, start = (windows_.first + index) * context;
  file_->read(start, context + 1, tokens);
  if (!windows_.pack) return;
  int64_t document = file_->document_of(start), begin = start, id = 0;
  int64_t next = file_->document_start(document + 1);
  for (int64_t i = 0; i < context; ++i) {
    if (start + i == next) {
      begin = next, ++id, ++document;
      next = file_->document_start(document + 1);
    }
    positions[i] = start + i - begin;
    documents[i] = id;
  }
}

Example TokenDataset::get_batch(const std::vector<int64_t>& indices) const {
  const auto n = int64_t(indices.size()), context = windows_.context;
  std::vector<int64_t> tokens(size_t(n * (context + 1)));
  std::vector<int64_t> positions(windows_.pack ? size_t(n * context) : 0);
  std::vector<int64_t> documents(positions.size());
  for (int64_t k = 0; k < n; ++k)
    fill(indices[size_t(k)], tokens.data() + k * (context + 1),
         windows_.pack ? positions.data() + k * context : nullptr,
         windows_.pack ? documents.data() + k * context : nullptr);
  const Tensor windows = from_vector(tokens, {n, context + 1});
  Example batch{windows.narrow(1, 0, context).contiguous(),
                windows.narrow(1, 1, context).contiguous()};
  if (windows_.pack) {
    batch.positions = from_vector(positions, {n, context});
    batch.document_ids = from_vector(documents, {n, context});
  }
  return batch;
}

Example TokenDataset::get(int64_t index) const {
  const Example batch = get_batch({index});
  const auto row = [](const Tensor& t) { return t.defined() ? t.select(0, 0) : t; };
  return {row(batch.input), row(batch.target), row(batch.positions), row(batch.document_ids)};
}

}  // namespace weave::data

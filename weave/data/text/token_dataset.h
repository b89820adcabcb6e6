#pragma once
// Tokenized text on disk, memory-mapped, and the dataset of training windows over it.
//
//   data::TokenFileWriter out("corpus.tokens", {.vocab_size = tok.vocab_size(),
//                                               .end_of_text = *tok.end_of_text()});
//   for (const auto& doc : docs) out.append_document(tok.encode(doc));   // (weave-tokenize)
//   out.finish();
//   auto file = std::make_shared<data::TokenFile>("corpus.tokens");
//   auto train = std::make_shared<data::TokenDataset>(file, data::TokenWindows{.context = 1024,
//                                                                             .pack = true});
//   data::DataLoader loader(train, {.batch_size = 8, .sampler = distributed_sampler});
//
// The file: a 64-byte header ("weavetok", version, bytes per token, token and document counts,
// vocabulary size, end-of-text id, where the index starts), the tokens (little-endian uint16
// when the vocabulary fits, else uint32), zeros to the next multiple of 8 bytes, then the
// index: each document's first token, and the token count (uint64). Opening checks every size
// against the file's, so a truncated file raises.
#include "weave/data/dataloader.h"
#include "weave/data/text/tokenizer.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "weave/data/files.h"

namespace weave::data {

/// The documents of a text: all of it, or with a separator, the runs of lines between lines
/// equal to it (the separator lines dropped, empty documents left out).
std::vector<std::string> split_documents(const std::string& text, const std::string& separator);

struct TokenFileOptions {
  int64_t vocab_size = 0;    // every token must be below it; > 65536 stores uint32
  int64_t end_of_text = -1;  // appended after each document (-1: nothing appended)
};

/// Writes a token file: documents stream to a fresh temporary file beside `path`
/// (data::AtomicFileWriter: created exclusively, never through a link another user planted;
/// each writer its own), renamed over it by finish(), so a killed writer leaves no half-written
/// file at path and two writers of one path each leave a whole file.
class TokenFileWriter {
 public:
  TokenFileWriter(std::string path, TokenFileOptions options);
  ~TokenFileWriter();
  TokenFileWriter(const TokenFileWriter&) = delete;
  TokenFileWriter& operator=(const TokenFileWriter&) = delete;
  /// Appends one document (and the end-of-text token); raises for a token outside the
  /// vocabulary, naming it.
  void append_document(std::span<const int32_t> tokens);
  void finish();
  int64_t tokens() const { return int64_t(written_); }
  int64_t documents() const { return int64_t(starts_.size()); }

 private:
  std::string path_;
  TokenFileOptions options_;
  std::unique_ptr<AtomicFileWriter> out_;  // null once finished
  uint64_t written_ = 0;                   // tokens
  std::vector<uint64_t> starts_;
  std::vector<unsigned char> buffer_;
};

struct TokenizeOptions {
  /// A line that separates documents inside a file; empty: each file is one document.
  std::string separator;
  /// End each document with the tokenizer's end-of-text token (raises if it has none).
  bool end_of_text = true;
  int threads = 0;  // encoding threads (0: the hardware's count)
  /// Called after each batch of files (about 16 MB) with the bytes read so far.
  std::function<void(uint64_t bytes)> on_progress = nullptr;
};

struct TokenizeStats {
  int64_t documents = 0, tokens = 0;
  uint64_t bytes = 0;  // of text
};

/// Encodes text files, in order, into a token file at `out`: batches of files, each batch's
/// documents on `threads` threads, written as they are done (what weave-tokenize runs).
TokenizeStats write_token_file(const std::string& out, const std::vector<std::string>& files,
                               const Tokenizer& tokenizer, const TokenizeOptions& options = {});

/// A token file, memory-mapped read-only. Opening reads every token once (a file whose
/// tokens fall outside its vocabulary raises there, naming the file and the position); later
/// the pages stay in the page cache as windows touch them.
class TokenFile {
 public:
  explicit TokenFile(const std::string& path);
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  int64_t size() const { return int64_t(tokens_); }
  int64_t documents() const { return int64_t(documents_); }
  int64_t vocab_size() const { return vocab_size_; }
  int64_t end_of_text() const { return end_of_text_; }
  int bytes_per_token() const { return token_bytes_; }
  const std::string& path() const { return path_; }
  /// Tokens [start, start + count) into out.
  void read(int64_t start, int64_t count, int64_t* out) const;
  /// The document that holds token i, and where that document starts.
  int64_t document_of(int64_t i) const;
  int64_t document_start(int64_t document) const;

 private:
  int64_t token_at(int64_t i) const;
  /// The first token not below vocab_size(), or -1.
  int64_t first_outside_vocabulary() const;

  std::string path_;
  const unsigned char* map_ = nullptr;
  size_t map_size_ = 0;
  uint64_t tokens_ = 0, documents_ = 0;
  int token_bytes_ = 0;
  int64_t vocab_size_ = 0, end_of_text_ = -1;
  const unsigned char* token_data_ = nullptr;
  const uint64_t* starts_ = nullptr;  // documents_ + 1 entries
};

struct TokenWindows {
  int64_t context = 0;  // tokens a window predicts
  /// Give each window's documents their own positions and ids (Example::positions and
  /// ::document_ids), for attention that stays inside a document; otherwise a window runs
  /// across documents as one sequence.
  bool pack = false;
  /// The windows [first, last) of the file's (size() - 1) / context (last -1: through the
  /// end), to hold out a part: windows never overlap, so two ranges share no token they predict.
  int64_t first = 0, last = -1;
};

/// Consecutive, non-overlapping windows of a token file: example i's input is context tokens
/// from (first + i) x context and its target the same shifted by one (int64, [context]);
/// packed, positions restart at 0 at each document start (and at the window's start) and
/// document ids count the window's documents from 0. Safe for loader workers (reads only).
class TokenDataset : public Dataset {
 public:
  TokenDataset(std::shared_ptr<const TokenFile> file, TokenWindows windows);
  int64_t size() const override { return last_ - windows_.first; }
  Example get(int64_t index) const override;
  Example get_batch(const std::vector<int64_t>& indices) const override;
  const TokenFile& file() const { return *file_; }

 private:
  // Window `index`'s tokens (context + 1) and, packed, positions and ids (context each).
  void fill(int64_t index, int64_t* tokens, int64_t* positions, int64_t* documents) const;
  std::shared_ptr<const TokenFile> file_;
  TokenWindows windows_;
  int64_t last_ = 0;
};

}  // namespace weave::data

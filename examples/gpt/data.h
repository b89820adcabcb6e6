#pragma once
// examples/gpt's data: the fortunes text as character ids (first 90% train, last 10% held
// out), windows at offsets every process derives from (seed, step), and with --pack each
// fortune a document of its own, ended by an end-of-text token, whose positions and ids go to
// the model beside the tokens.
#include <weave/weave.h>

#include "flags.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace gpt {

struct Corpus {
  std::vector<int64_t> train, heldout;  // token ids
  std::vector<unsigned char> chars;     // id -> byte
  int64_t vocab = 0;  // chars.size() (+ 1 for end-of-text) padded to a multiple of 8 (for tp)
  int64_t end_of_text = -1;  // the id that ends each fortune under --pack; -1 without
};

/// Every fortune file in name order. Between fortunes (a `%` line) comes a newline, or with
/// pack an end-of-text token: the same number of tokens either way, so losses compare.
inline Corpus load_corpus(const std::string& dir, bool pack) {
  namespace fs = std::filesystem;
  WEAVE_CHECK(fs::is_directory(dir), "gpt",
              "no fortunes at {}; hint: apt-get install fortunes, or pass --data DIR", dir);
  std::vector<std::string> files;
  uintmax_t bytes = 0;
  for (const auto& path : data::files_in(dir, {".dat"})) {
    const uintmax_t size = fs::file_size(path);
    if (size == 0) continue;  // empty, or a kernel's pseudo-file (under /proc), read forever
    bytes += size, files.push_back(path);
  }
  WEAVE_CHECK(bytes <= (uintmax_t(1) << 30), "gpt",
              "the files in {} hold {} bytes; the example reads at most 1 GiB of text; hint: "
              "--data a folder of text files",
              dir, bytes);
  std::string text;
  std::vector<size_t> separators;
  for (const auto& path : files) {
    const std::string content = data::read_file(path);
    const size_t zero = content.find('\0');
    WEAVE_CHECK(zero == std::string::npos, "gpt",
                "{} is not text (a zero byte at offset {}); hint: --data a folder of text files",
                path, zero);
    std::istringstream in(content);
    for (std::string line; std::getline(in, line);) {
      if (line == "%") separators.push_back(text.size());
      text += line == "%" ? "\n" : line + "\n";
    }
  }
  WEAVE_CHECK(text.size() > 1000, "gpt", "found only {} bytes of text in {}", text.size(), dir);
  Corpus corpus;
  const std::set<unsigned char> seen(text.begin(), text.end());
  corpus.chars.assign(seen.begin(), seen.end());
  if (pack) corpus.end_of_text = int64_t(corpus.chars.size());
  corpus.vocab = (int64_t(corpus.chars.size()) + (pack ? 1 : 0) + 7) / 8 * 8;
  std::array<int64_t, 256> id_of{};
  for (size_t i = 0; i < corpus.chars.size(); ++i) id_of[corpus.chars[i]] = int64_t(i);
  std::vector<int64_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = id_of[(unsigned char)text[i]];
  if (pack)
    for (size_t at : separators) ids[at] = corpus.end_of_text;
  const size_t split = text.size() * 9 / 10;
  corpus.train.assign(ids.begin(), ids.begin() + std::ptrdiff_t(split));
  corpus.heldout.assign(ids.begin() + std::ptrdiff_t(split), ids.end());
  return corpus;
}

// The same in bench/training/gpt_torch.py: window offsets from (seed, step, index), on every
// process.
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

inline std::vector<int64_t> train_offsets(const Flags& f, int64_t text_size, int64_t step) {
  std::vector<int64_t> offsets;
  for (int64_t i = 0; i < f.batch; ++i)
    offsets.push_back(int64_t(splitmix64((f.seed << 40) + uint64_t(step * f.batch + i)) %
                              uint64_t(text_size - f.context - 1)));
  return offsets;
}

/// A batch of windows: inputs and targets [n, context]; with packing, each input token's
/// position in its document and the document's index in the window (both [n, context]).
struct Batch {
  Tensor inputs, targets, positions, documents;
  /// The model's inputs: the tokens and, packed, their positions and documents.
  nn::Inputs model_inputs() const { return {inputs, positions, documents}; }
};

/// Windows of context + 1 tokens at the given offsets. An end-of-text token opens the next
/// document (position 0 there), so no prediction sees across a boundary; the window's first
/// document starts at position 0 too (rotary positions are relative, so nothing changes).
inline Batch make_batch(const std::vector<int64_t>& tokens, const std::vector<int64_t>& offsets,
                        int64_t context, int64_t end_of_text, Device device) {
  const int64_t n = int64_t(offsets.size());
  std::vector<int64_t> all, positions, documents;
  all.reserve(size_t(n * (context + 1)));
  for (int64_t start : offsets) {
    all.insert(all.end(), tokens.begin() + start, tokens.begin() + start + context + 1);
    int64_t position = 0, document = 0;
    for (int64_t i = 0; end_of_text >= 0 && i < context; ++i) {
      if (tokens[size_t(start + i)] == end_of_text && i > 0) position = 0, ++document;
      positions.push_back(position++);
      documents.push_back(document);
    }
  }
  Tensor w = from_vector(all, {n, context + 1}).to(device);
  Batch batch{w.narrow(1, 0, context), w.narrow(1, 1, context), {}, {}};
  if (end_of_text >= 0) {
    batch.positions = from_vector(positions, {n, context}).to(device);
    batch.documents = from_vector(documents, {n, context}).to(device);
  }
  return batch;
}

/// This rank's micro-batches of the step's global batch: its share of the windows, cut into
/// --microbatch windows each (one micro-batch of its whole share without), dealt by global index
/// (parallel::MicroBatchPlan), so that a micro-batch holds the same windows at any layout.
inline std::vector<Batch> microbatches(const Flags& f, const Corpus& corpus, int data,
                                       int data_rank, int64_t step, Device device) {
  const int64_t size = f.microbatch > 0 ? f.microbatch : f.batch / data;
  const parallel::MicroBatchPlan plan(f.batch, size, data, data_rank);
  const std::vector<int64_t> offsets = train_offsets(f, int64_t(corpus.train.size()), step);
  std::vector<Batch> batches;
  for (int64_t i = 0; i < plan.local(); ++i) {
    const auto [begin, end] = plan.items(i);
    batches.push_back(make_batch(corpus.train, {offsets.begin() + begin, offsets.begin() + end},
                                 f.context, corpus.end_of_text, device));
  }
  return batches;
}

/// Under --reproducible: this rank's held-out windows in micro-batches of --microbatch, dealt by
/// global index, each with its count of windows. Every rank gets as many (a sharded model's
/// gathers pair up): a rank out of them repeats its first, counting 0 windows.
inline std::vector<std::pair<Batch, int64_t>> heldout_microbatches(const Flags& f,
                                                                   const Corpus& corpus, int data,
                                                                   int data_rank, Device device) {
  const int64_t span = int64_t(corpus.heldout.size()) - f.context - 1;
  const parallel::MicroBatchPlan plan(f.eval_windows, f.microbatch, data, data_rank);
  std::vector<std::pair<Batch, int64_t>> out;
  for (int64_t i = 0; i < plan.local(); ++i) {
    const auto [begin, end] = plan.items(i);
    std::vector<int64_t> windows;
    for (int64_t w = begin; w < end; ++w) windows.push_back(w * span / f.eval_windows);
    out.push_back(
        {make_batch(corpus.heldout, windows, f.context, corpus.end_of_text, device), end - begin});
  }
  const int64_t most = (plan.count() + data - 1) / data;
  while (int64_t(out.size()) < most) out.push_back({out.front().first, 0});
  return out;
}

}  // namespace gpt

// weave-tokenize: text files to a token file (data::TokenFile) for data::TokenDataset.
//
//   weave-tokenize --tokenizer DIR -o OUT.tokens [--separator LINE] [--skip-suffix .dat]
//                  [--threads N] [--no-end-of-text] [--quiet] INPUT...
//
// DIR holds the tokenizer (tokenizer.json, vocab.json + merges.txt, or encoder.json +
// vocab.bpe). Each INPUT is a file or a folder of them (name order; links and files ending in a
// --skip-suffix skipped). Each file is a document, or with --separator, each run of lines
// between lines equal to it; every document ends with the end-of-text token unless
// --no-end-of-text. Documents are encoded on --threads threads (the hardware's count by
// default), in order; a progress bar on stderr shows bytes done, MB/s and the time left.
// A killed run leaves no file at OUT (it writes a fresh temporary file beside OUT, created
// exclusively, renamed over OUT when done).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "weave/data/files.h"
#include "weave/data/text/token_dataset.h"
#include "weave/data/text/tokenizer.h"

namespace {

using namespace weave;
namespace fs = std::filesystem;

class Progress {
 public:
  Progress(uint64_t total, bool quiet) : total_(total), quiet_(quiet), tty_(::isatty(2)) {}
  void update(uint64_t done, bool last = false) {
    if (quiet_) return;
    const double seconds = elapsed();
    const int percent = total_ ? int(100 * done / total_) : 100;
    if (!tty_ && percent < next_percent_) return;  // a log: every 10%
    next_percent_ = percent / 10 * 10 + 10;
    const double rate = seconds > 0 ? double(done) / 1e6 / seconds : 0;
    const double left = rate > 0 ? double(total_ - done) / 1e6 / rate : 0;
    const int filled = percent * 30 / 100;
    std::fprintf(stderr, "%s[%s%s] %3d%% %.1f/%.1f MB %.1f MB/s %.0fs left%s", tty_ ? "\r" : "",
                 std::string(size_t(filled), '#').c_str(),
                 std::string(size_t(30 - filled), ' ').c_str(), percent, double(done) / 1e6,
                 double(total_) / 1e6, rate, left, tty_ && !last ? "" : "\n");
  }
  double elapsed() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  uint64_t total_;
  bool quiet_, tty_;
  int next_percent_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Turns text files into a token file for data::TokenDataset.", "weave-tokenize");
  std::string tokenizer_dir, out, separator;
  std::vector<std::string> inputs, skip_suffixes;
  int threads = 0;
  bool no_end_of_text = false, quiet = false;
  app.add_option("--tokenizer", tokenizer_dir, "folder with the tokenizer's files")->required();
  app.add_option("-o,--out", out, "the token file to write")->required();
  app.add_option("--separator", separator, "a line that separates documents inside a file");
  app.add_option("--skip-suffix", skip_suffixes, "skip files in folders whose names end so");
  app.add_option("--threads", threads, "encoding threads (0: the hardware's count)");
  app.add_flag("--no-end-of-text", no_end_of_text, "append nothing after each document");
  app.add_flag("--quiet", quiet, "no progress bar");
  app.add_option("inputs", inputs, "text files or folders of them")->required();
  CLI11_PARSE(app, argc, argv);
  try {
    const auto tok = data::Tokenizer::from_directory(tokenizer_dir);
    WEAVE_CHECK(no_end_of_text || tok.end_of_text(), "weave-tokenize",
                "the tokenizer in {} has no end-of-text token; hint: --no-end-of-text",
                tokenizer_dir);
    std::vector<std::string> files;
    for (const auto& input : inputs)
      for (auto& file : data::files_in(input, skip_suffixes)) files.push_back(std::move(file));
    uint64_t total = 0;
    for (const auto& f : files) total += fs::file_size(f);
    Progress progress(total, quiet);
    const data::TokenizeStats stats =
        data::write_token_file(out, files, tok,
                               {.separator = separator,
                                .end_of_text = !no_end_of_text,
                                .threads = threads,
                                .on_progress = [&](uint64_t bytes) { progress.update(bytes); }});
    progress.update(stats.bytes, true);
    std::fflush(stderr);
    std::printf(
        "%s: %lld documents, %lld tokens (%s, vocabulary %lld), %.2f bytes a token, "
        "%.1f s\n",
        out.c_str(), static_cast<long long>(stats.documents), static_cast<long long>(stats.tokens),
        tok.vocab_size() > 65536 ? "uint32" : "uint16", static_cast<long long>(tok.vocab_size()),
        stats.tokens ? double(total) / double(stats.tokens) : 0.0, progress.elapsed());
  } catch (const std::exception& e) {  // weave's errors, and the file system's
    std::fprintf(stderr, "weave-tokenize: %s\n", e.what());
    return 1;
  }
}

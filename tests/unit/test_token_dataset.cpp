// Token files and the windows over them: what is written reads back, windows and their packed
// positions and document ids equal ones computed from the document list by hand, and a loader
// over them with a distributed sampler and workers resumes exactly.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "helpers.h"

using namespace weave;

namespace {

std::filesystem::path temp_path(const std::string& name) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("weave_tokens_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir / name;
}

// Documents of random lengths (1 to 40) and tokens below vocab.
std::vector<std::vector<int32_t>> random_documents(int count, int64_t vocab, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<std::vector<int32_t>> documents{size_t(count)};
  for (auto& d : documents) {
    d.resize(1 + gen() % 40);
    for (auto& t : d) t = int32_t(gen() % uint64_t(vocab - 1));  // below end-of-text
  }
  return documents;
}

std::string write_tokens(const std::string& name, const std::vector<std::vector<int32_t>>& docs,
                         int64_t vocab, int64_t end_of_text) {
  const std::string path = temp_path(name).string();
  data::TokenFileWriter writer(path, {.vocab_size = vocab, .end_of_text = end_of_text});
  for (const auto& d : docs) writer.append_document(d);
  writer.finish();
  return path;
}

std::vector<int64_t> values(const Tensor& t) {
  const Tensor c = t.contiguous();
  return {c.data<int64_t>(), c.data<int64_t>() + c.numel()};
}

}  // namespace

TEST_SUITE("token_dataset") {
  TEST_CASE("a token file reads back its documents, as uint16 or uint32") {
    for (int64_t vocab : {int64_t(50257), int64_t(128256)}) {
      const auto docs = random_documents(200, vocab, uint64_t(vocab));
      const auto path = write_tokens("read.tokens", docs, vocab, vocab - 1);
      const data::TokenFile file(path);
      CHECK(file.bytes_per_token() == (vocab > 65536 ? 4 : 2));
      CHECK(file.vocab_size() == vocab);
      CHECK(file.end_of_text() == vocab - 1);
      REQUIRE(file.documents() == 200);
      std::vector<int64_t> all(size_t(file.size()));
      file.read(0, file.size(), all.data());
      size_t at = 0;
      for (size_t d = 0; d < docs.size(); ++d) {
        CHECK(file.document_start(int64_t(d)) == int64_t(at));
        CHECK(file.document_of(int64_t(at)) == int64_t(d));
        for (int32_t t : docs[d]) CHECK(all[at++] == t);
        CHECK(all[at++] == vocab - 1);  // each document's end-of-text
      }
      CHECK(at == all.size());
      const size_t tokens_end = 64 + all.size() * size_t(file.bytes_per_token());
      CHECK(std::filesystem::file_size(path) == (tokens_end + 7) / 8 * 8 + (docs.size() + 1) * 8);
    }
  }

  TEST_CASE("windows and their packed positions and document ids") {
    const auto docs = random_documents(300, 1000, 7);
    const auto path = write_tokens("windows.tokens", docs, 1000, 999);
    auto file = std::make_shared<const data::TokenFile>(path);
    // The stream and every token's document, by hand.
    std::vector<int64_t> stream, document_of;
    for (size_t d = 0; d < docs.size(); ++d) {
      for (int64_t t : docs[d]) stream.push_back(t), document_of.push_back(int64_t(d));
      stream.push_back(999), document_of.push_back(int64_t(d));
    }
    const int64_t context = 16;
    const data::TokenDataset plain(file, {.context = context});
    const data::TokenDataset packed(file,
                                    {.context = context, .pack = true, .first = 3, .last = 40});
    CHECK(plain.size() == int64_t(stream.size() - 1) / context);
    CHECK(packed.size() == 37);
    CHECK_FALSE(plain.get(0).positions.defined());
    for (int64_t i = 0; i < packed.size(); ++i) {
      const data::Example e = packed.get(i);
      const int64_t start = (3 + i) * context;
      std::vector<int64_t> positions, ids;
      for (int64_t k = 0; k < context; ++k) {
        const int64_t p = start + k;
        int64_t begin = p;  // back to the document's start or the window's
        while (begin > start && document_of[size_t(begin - 1)] == document_of[size_t(p)]) --begin;
        positions.push_back(p - begin);
        ids.push_back(document_of[size_t(p)] - document_of[size_t(start)]);
        CHECK(values(e.input)[size_t(k)] == stream[size_t(p)]);
        CHECK(values(e.target)[size_t(k)] == stream[size_t(p + 1)]);
      }
      CHECK(values(e.positions) == positions);
      CHECK(values(e.document_ids) == ids);
    }
    const data::Example batch = packed.get_batch({5, 0, 36});
    CHECK(batch.input.shape() == Shape{3, context});
    CHECK(values(batch.document_ids.select(0, 2)) == values(packed.get(36).document_ids));
  }

  TEST_CASE("a loader with a distributed sampler and workers resumes where it was saved") {
    const auto path = write_tokens("loader.tokens", random_documents(400, 500, 3), 500, 499);
    auto dataset =
        std::make_shared<const data::TokenDataset>(std::make_shared<const data::TokenFile>(path),
                                                   data::TokenWindows{.context = 8, .pack = true});
    const auto loader_for = [&](int workers) {
      auto sampler = std::make_shared<parallel::DistributedSampler>(
          dataset->size(), 2, 1, parallel::DistributedSamplerOptions{.seed = 5});
      return std::make_unique<data::DataLoader>(
          dataset,
          data::DataLoaderOptions{.batch_size = 4, .sampler = sampler, .num_workers = workers});
    };
    std::vector<std::vector<int64_t>> whole;
    auto reference = loader_for(0);
    for (const auto& b : *reference)
      whole.push_back(values(b.positions)), whole.push_back(values(b.input));
    REQUIRE(whole.size() > 20);
    auto first = loader_for(2);
    std::vector<std::vector<int64_t>> resumed;
    data::LoaderState saved;
    int64_t taken = 0;
    for (const auto& b : *first) {
      resumed.push_back(values(b.positions)), resumed.push_back(values(b.input));
      if (++taken == 5) {
        saved = first->state();
        break;
      }
    }
    auto second = loader_for(2);
    second->load_state(saved);
    for (const auto& b : *second)
      resumed.push_back(values(b.positions)), resumed.push_back(values(b.input));
    CHECK(resumed == whole);
  }

  TEST_CASE("documents split at separator lines") {
    CHECK(data::split_documents("a\n%\nb\nc\n%\n%\n\n%", "%") ==
          std::vector<std::string>{"a\n", "b\nc\n", "\n"});
    CHECK(data::split_documents("no separator\n", "") ==
          std::vector<std::string>{"no separator\n"});
    CHECK(data::split_documents("x %\n%x\n", "%") == std::vector<std::string>{"x %\n%x\n"});
  }

  TEST_CASE("bad token files and tokens raise") {
    const auto path = write_tokens("bad.tokens", random_documents(10, 100, 1), 100, 99);
    const auto size = std::filesystem::file_size(path);
    std::filesystem::resize_file(path, size - 8);
    CHECK_THROWS_WITH_AS(data::TokenFile{path}, doctest::Contains("truncated"), Error);
    std::ofstream(path)
        << "not a token file, but long enough to hold a header, at 64 bytes or more";
    CHECK_THROWS_WITH_AS(data::TokenFile{path}, doctest::Contains("magic"), Error);
    data::TokenFileWriter writer(temp_path("never.tokens").string(), {.vocab_size = 100});
    CHECK_THROWS_WITH_AS(writer.append_document(std::vector<int32_t>{1, 100}),
                         doctest::Contains("token 100 of document 0 is outside the vocabulary"),
                         Error);
    auto file =
        std::make_shared<const data::TokenFile>(write_tokens("short.tokens", {{1, 2, 3}}, 100, -1));
    CHECK_THROWS_WITH_AS(data::TokenDataset(file, {.context = 8}), doctest::Contains("windows"),
                         Error);
    CHECK_FALSE(std::filesystem::exists(temp_path("never.tokens")));
    CHECK_THROWS_WITH_AS(writer.append_document(std::vector<int32_t>{-1}),
                         doctest::Contains("token -1 of document 0 is outside the vocabulary"),
                         Error);
  }

  TEST_CASE(
      "a token file's writer follows no planted link, and two writers each leave a whole "
      "file") {
    namespace fs = std::filesystem;
    const fs::path victim = temp_path("victim"), out = temp_path("planted.tokens");
    std::ofstream(victim) << "precious";
    fs::remove(out.string() + ".partial");
    fs::create_symlink(victim, out.string() + ".partial");  // the old fixed temporary's name
    write_tokens("planted.tokens", {{1, 2, 3}}, 100, -1);
    CHECK(data::read_file(victim.string()) == "precious");
    fs::remove(out);
    fs::create_symlink(victim, out);  // a link at the output itself is replaced, not followed
    write_tokens("planted.tokens", {{4, 5}}, 100, -1);
    CHECK(data::read_file(victim.string()) == "precious");
    CHECK(!fs::is_symlink(out));
    CHECK(data::TokenFile(out.string()).size() == 2);
    // Interleaved writers of one path: each finishes whole; the last to finish is the file.
    data::TokenFileWriter first(out.string(), {.vocab_size = 100});
    data::TokenFileWriter second(out.string(), {.vocab_size = 100});
    first.append_document(std::vector<int32_t>{1, 2, 3, 4});
    second.append_document(std::vector<int32_t>{7, 8, 9});
    first.finish();
    CHECK(data::TokenFile(out.string()).size() == 4);
    second.finish();
    CHECK(data::TokenFile(out.string()).size() == 3);
  }

  TEST_CASE("a token file holding an id outside its vocabulary raises at open, naming where") {
    // GPT-2's vocabulary (uint16 tokens); token 37 becomes 50257, one past its last id.
    std::vector<int32_t> tokens(100);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int32_t(i * 503 % 50257);
    const std::string path = write_tokens("outside.tokens", {tokens}, 50257, 50256);
    CHECK(data::TokenFile(path).size() == 101);  // a valid file opens
    {
      std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
      file.seekp(64 + 2 * 37);
      const unsigned char bytes[2] = {50257 & 0xff, 50257 >> 8};
      file.write(reinterpret_cast<const char*>(bytes), 2);
    }
    CHECK_WEAVE_ERROR(data::TokenFile{path}, "TokenFile",
                      path +
                          " is not a valid token file: token 37 is 50257, outside its "
                          "vocabulary of 50257");
    // uint32 tokens (a vocabulary past 65536) are checked the same way.
    const std::string wide = write_tokens("wide.tokens", {{1, 70000, 3}}, 70001, -1);
    CHECK(data::TokenFile(wide).size() == 3);
    {
      std::fstream file(wide, std::ios::in | std::ios::out | std::ios::binary);
      file.seekp(64 + 4 * 2);
      const uint32_t value = 70001;
      file.write(reinterpret_cast<const char*>(&value), 4);
    }
    CHECK_WEAVE_ERROR(data::TokenFile{wide}, "TokenFile", "token 2 is 70001");
  }
}

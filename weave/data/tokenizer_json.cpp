// Hugging Face's tokenizer.json, for the byte-level BPE models; everything this reader does not
// implement raises, naming the field, rather than encode differently from the model's own.
#include "weave/data/files.h"
#include "weave/data/tokenizer.h"
#include "weave/data/tokenizer_impl.h"
#include "weave/tensor/error.h"

#include <nlohmann/json.hpp>

namespace weave::data {
namespace {

using json = nlohmann::json;

// The Split patterns published with byte-level BPE models, each a rule split_pieces knows.
SplitRule rule_of_pattern(const std::string& pattern, const std::string& path) {
  const std::string contractions = "'s|'t|'re|'ve|'m|'ll|'d";
  const std::string tail = R"( ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  if (pattern == contractions + R"(| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)")
    return SplitRule::kGpt2;
  const std::string llama = "(?i:" + contractions + R"()|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N})";
  if (pattern == llama + "{1,3}|" + tail) return SplitRule::kLlama3;
  if (pattern == llama + "|" + tail) return SplitRule::kLlama3SingleDigits;
  WEAVE_FAIL("tokenizer",
             "{}: the pre-tokenizer splits by the pattern {}, which weave does not implement; "
             "hint: GPT-2's, Llama 3's and Qwen 2's patterns are supported",
             path, pattern);
}

// ByteLevel alone (its own GPT-2 split), or a Split followed by ByteLevel without its split.
void read_pre_tokenizer(const json& pre, Tokenizer::Impl& impl, const std::string& path) {
  WEAVE_CHECK(pre.is_object(), "tokenizer",
              "{}: expected a pre_tokenizer (byte-level BPE models have one), found {}", path,
              pre.type_name());
  const std::string type = pre.value("type", "");
  const auto byte_level = [&](const json& p, bool split_already) {
    impl.add_prefix_space = p.value("add_prefix_space", false);
    const bool use_regex = p.value("use_regex", true);
    WEAVE_CHECK(use_regex != split_already, "tokenizer",
                "{}: a ByteLevel pre-tokenizer with use_regex {} {} a Split before it; weave "
                "takes exactly one split",
                path, use_regex, split_already ? "after" : "without");
  };
  if (type == "ByteLevel") return byte_level(pre, false);
  const json& steps = pre.value("pretokenizers", json::array());
  WEAVE_CHECK(
      type == "Sequence" && steps.size() == 2 && steps[0].value("type", "") == "Split" &&
          steps[1].value("type", "") == "ByteLevel",
      "tokenizer",
      "{}: unsupported pre_tokenizer {}; hint: weave reads byte-level BPE models (ByteLevel, "
      "or Split then ByteLevel)",
      path, pre.dump().substr(0, 200));
  const json& split = steps[0];
  WEAVE_CHECK(split.value("behavior", "") == "Isolated" && !split.value("invert", false) &&
                  split.contains("pattern") && split["pattern"].contains("Regex"),
              "tokenizer", "{}: unsupported Split {}", path, split.dump().substr(0, 200));
  impl.rule = rule_of_pattern(split["pattern"]["Regex"].get<std::string>(), path);
  byte_level(steps[1], true);
}

void read_merges(const json& merges, Tokenizer::Impl& impl, const std::string& path) {
  WEAVE_CHECK(merges.is_array(), "tokenizer", "{}: model.merges is not a list", path);
  for (const json& merge : merges) {
    if (merge.is_array() && merge.size() == 2) {  // newer files: ["left", "right"]
      impl.add_merge(merge[0].get<std::string>(), merge[1].get<std::string>(), path.c_str());
      continue;
    }
    WEAVE_CHECK(merge.is_string(), "tokenizer", "{}: a merge is {}, expected \"left right\"", path,
                merge.dump());
    const auto text = merge.get<std::string>();
    const size_t space = text.find(' ');
    WEAVE_CHECK(space != std::string::npos, "tokenizer", "{}: merge '{}' has no space", path, text);
    impl.add_merge(std::string_view(text).substr(0, space),
                   std::string_view(text).substr(space + 1), path.c_str());
  }
}

void read_added_tokens(const json& added, Tokenizer::Impl& impl, const std::string& path) {
  for (const json& token : added) {
    for (const char* option : {"single_word", "lstrip", "rstrip"})
      WEAVE_CHECK(!token.value(option, false), "tokenizer",
                  "{}: added token {} sets {}, which weave does not implement", path,
                  token.value("content", ""), option);
    impl.add_token(token.at("content").get<std::string>(), token.at("id").get<int32_t>(),
                   token.value("special", false));
  }
}

// TemplateProcessing's single-sequence template: the special tokens before and after $A.
void read_post_processor(const json& post, Tokenizer::Impl& impl, const std::string& path) {
  if (post.is_null()) return;
  const std::string type = post.value("type", "");
  if (type == "ByteLevel") return;  // offsets only
  WEAVE_CHECK(type == "TemplateProcessing", "tokenizer",
              "{}: unsupported post_processor type '{}'; hint: ByteLevel and TemplateProcessing "
              "are supported",
              path, type);
  bool after = false;
  for (const json& piece : post.at("single")) {
    if (piece.contains("Sequence")) {
      after = true;
      continue;
    }
    const std::string name = piece.at("SpecialToken").at("id").get<std::string>();
    for (const json& id : post.at("special_tokens").at(name).at("ids"))
      (after ? impl.suffix : impl.prefix).push_back(id.get<int32_t>());
  }
}

}  // namespace

Tokenizer Tokenizer::from_hf_json(const std::string& path) {
  json root;
  try {
    root = json::parse(read_file(path));
  } catch (const json::exception& e) {
    WEAVE_FAIL("tokenizer", "{} is not valid JSON: {}", path, e.what());
  }
  auto impl = std::make_unique<Impl>();
  try {
    const json& model = root.at("model");
    const std::string type = model.value("type", "BPE");
    WEAVE_CHECK(type == "BPE", "tokenizer",
                "{}: model type '{}' is not supported; hint: weave reads byte-level BPE "
                "tokenizers (GPT-2, Llama 3, Qwen 2), not {} ones",
                path, type, type);
    WEAVE_CHECK(!model.value("byte_fallback", false), "tokenizer",
                "{}: a BPE model with byte_fallback (SentencePiece's, as Llama 2 and Mistral use) "
                "is not supported; hint: weave reads byte-level BPE tokenizers",
                path);
    WEAVE_CHECK(root.value("normalizer", json()).is_null(), "tokenizer",
                "{}: normalizer {} is not supported", path,
                root["normalizer"].dump().substr(0, 100));
    read_pre_tokenizer(root.value("pre_tokenizer", json()), *impl, path);
    impl->ignore_merges = model.value("ignore_merges", false);
    impl->add_vocab(model.at("vocab"), path.c_str());
    read_merges(model.at("merges"), *impl, path);
    read_added_tokens(root.value("added_tokens", json::array()), *impl, path);
    read_post_processor(root.value("post_processor", json()), *impl, path);
  } catch (const json::exception& e) {
    WEAVE_FAIL("tokenizer", "{} is not a tokenizer.json weave can read: {}", path, e.what());
  }
  return Tokenizer(std::move(impl));
}

}  // namespace weave::data

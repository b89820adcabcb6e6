// Hugging Face's tokenizer.json, for the byte-level BPE models; everything this reader does not
// implement raises, naming the field, rather than encode differently from the model's own.
#include "weave/data/files.h"
#include "weave/data/text/tokenizer.h"
#include "weave/data/text/tokenizer_impl.h"
#include "weave/tensor/error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>

namespace weave::data {
namespace {

using json = nlohmann::json;

// The Split pattern published with byte-level BPE models for each rule split_pieces knows.
std::string pattern_of(SplitRule rule) {
  const std::string contractions = "'s|'t|'re|'ve|'m|'ll|'d";
  const std::string tail = R"( ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  const std::string llama = "(?i:" + contractions + R"()|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N})";
  switch (rule) {
    case SplitRule::kGpt2:
      return contractions + R"(| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
    case SplitRule::kLlama3:
      return llama + "{1,3}|" + tail;
    case SplitRule::kLlama3SingleDigits:
      return llama + "|" + tail;
  }
  return "";
}

SplitRule rule_of_pattern(const std::string& pattern, const std::string& path) {
  for (SplitRule rule : {SplitRule::kGpt2, SplitRule::kLlama3, SplitRule::kLlama3SingleDigits})
    if (pattern == pattern_of(rule)) return rule;
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
    const std::string content = token.at("content").get<std::string>();
    impl.add_token(content, Tokenizer::Impl::id_from(token.at("id"), content, path.c_str()),
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
      (after ? impl.suffix : impl.prefix)
          .push_back(Tokenizer::Impl::id_from(id, name, path.c_str()));
  }
}

json byte_level(bool add_prefix_space, bool use_regex) {
  return {{"type", "ByteLevel"},
          {"add_prefix_space", add_prefix_space},
          {"trim_offsets", true},
          {"use_regex", use_regex}};
}

// GPT-2's own split inside ByteLevel, or a Split by the rule's pattern before it.
json pre_tokenizer_of(const Tokenizer::Impl& impl) {
  if (impl.rule == SplitRule::kGpt2) return byte_level(impl.add_prefix_space, true);
  const json split = {{"type", "Split"},
                      {"pattern", {{"Regex", pattern_of(impl.rule)}}},
                      {"behavior", "Isolated"},
                      {"invert", false}};
  return {{"type", "Sequence"},
          {"pretokenizers", json::array({split, byte_level(impl.add_prefix_space, false)})}};
}

// The special tokens before and after every sequence, as TemplateProcessing (ByteLevel: none).
json post_processor_of(const Tokenizer::Impl& impl) {
  if (impl.prefix.empty() && impl.suffix.empty()) return byte_level(true, true);
  json single = json::array(), special = json::object();
  auto add = [&](int32_t id) {
    const std::string& text = impl.token_bytes[size_t(id)];
    single.push_back({{"SpecialToken", {{"id", text}, {"type_id", 0}}}});
    special[text] = {{"id", text}, {"ids", {id}}, {"tokens", {text}}};
  };
  for (int32_t id : impl.prefix) add(id);
  single.push_back({{"Sequence", {{"id", "A"}, {"type_id", 0}}}});
  for (int32_t id : impl.suffix) add(id);
  return {{"type", "TemplateProcessing"},
          {"single", single},
          {"pair", single},
          {"special_tokens", special}};
}

}  // namespace

std::string Tokenizer::hf_json() const {
  const Impl& impl = *impl_;
  json vocab = json::object();
  for (const auto& [bytes, id] : impl.vocab) vocab[Impl::bytes_to_alphabet(bytes)] = id;
  std::vector<std::pair<int32_t, uint64_t>> by_rank;  // (rank, pair key)
  for (const auto& [key, merge] : impl.merges) by_rank.emplace_back(merge.rank, key);
  std::sort(by_rank.begin(), by_rank.end());
  json merges = json::array();
  for (const auto& [rank, key] : by_rank)
    merges.push_back(Impl::bytes_to_alphabet(impl.token_bytes[key >> 32]) + " " +
                     Impl::bytes_to_alphabet(impl.token_bytes[key & 0xFFFFFFFFu]));
  json added = json::array();
  std::vector<Impl::Added> in_order = impl.added;
  std::sort(in_order.begin(), in_order.end(),
            [](const auto& a, const auto& b) { return a.id < b.id; });
  for (const Impl::Added& token : in_order)
    added.push_back({{"id", token.id},
                     {"content", token.content},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", token.special}});
  const json root = {{"version", "1.0"},
                     {"truncation", nullptr},
                     {"padding", nullptr},
                     {"added_tokens", added},
                     {"normalizer", nullptr},
                     {"pre_tokenizer", pre_tokenizer_of(impl)},
                     {"post_processor", post_processor_of(impl)},
                     {"decoder", byte_level(true, true)},
                     {"model",
                      {{"type", "BPE"},
                       {"dropout", nullptr},
                       {"unk_token", nullptr},
                       {"continuing_subword_prefix", nullptr},
                       {"end_of_word_suffix", nullptr},
                       {"fuse_unk", false},
                       {"byte_fallback", false},
                       {"ignore_merges", impl.ignore_merges},
                       {"vocab", vocab},
                       {"merges", merges}}}};
  return root.dump(2);
}

void Tokenizer::save_pretrained(const std::string& dir) const {
  std::filesystem::create_directories(dir);
  write_file_atomically(dir + "/tokenizer.json", hf_json());
  // The special tokens transformers looks for by role: end-of-text as eos (and as bos where the
  // model has no beginning-of-text token of its own, as GPT-2's files say).
  json roles = json::object();
  const std::optional<int32_t> eos = end_of_text();
  std::optional<int32_t> bos = token_id("<|begin_of_text|>");
  if (!bos) bos = eos;
  if (bos) roles["bos_token"] = impl_->token_bytes[size_t(*bos)];
  if (eos) roles["eos_token"] = impl_->token_bytes[size_t(*eos)];
  json config = roles;
  config["tokenizer_class"] = "PreTrainedTokenizerFast";
  config["clean_up_tokenization_spaces"] = false;
  write_file_atomically(dir + "/tokenizer_config.json", config.dump(2));
  write_file_atomically(dir + "/special_tokens_map.json", roles.dump(2));
}

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

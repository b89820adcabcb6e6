// Hugging Face's tokenizer.json, tokenizer_config.json and generation_config.json: read into a
// data::Tokenizer and written back. Everything this reader does not implement raises, naming the
// field, rather than encode differently from the model's own.
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
  const bool normalizes = !impl.pipeline.normalizers.empty();
  for (const json& token : added) {
    for (const char* option : {"single_word", "lstrip", "rstrip"})
      WEAVE_CHECK(!token.value(option, false), "tokenizer",
                  "{}: added token {} sets {}, which weave does not implement", path,
                  token.value("content", ""), option);
    const std::string content = token.at("content").get<std::string>();
    const bool special = token.value("special", false);
    WEAVE_CHECK(special || !normalizes || !token.value("normalized", !special), "tokenizer",
                "{}: added token {} is matched in normalized text (normalized: true), which "
                "weave does not implement",
                path, content);
    impl.add_token(content, Tokenizer::Impl::id_from(token.at("id"), content, path.c_str()),
                   special);
  }
}

// TemplateProcessing's single-sequence template: the special tokens before and after $A (also
// inside a Sequence beside ByteLevel, as Llama 3.1's files have it).
void read_post_processor(const json& post, Tokenizer::Impl& impl, const std::string& path) {
  if (post.is_null()) return;
  const std::string type = post.value("type", "");
  if (type == "ByteLevel") return;  // offsets only
  if (type == "Sequence") {
    for (const json& step : post.at("processors")) read_post_processor(step, impl, path);
    return;
  }
  WEAVE_CHECK(type == "TemplateProcessing", "tokenizer",
              "{}: unsupported post_processor type '{}'; hint: ByteLevel, TemplateProcessing and "
              "a Sequence of them are supported",
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

// The BPE model's options weave implements; the others raise by name.
void read_model_options(const json& model, Tokenizer::Impl& impl, const std::string& path) {
  const std::string type = model.value("type", "BPE");
  WEAVE_CHECK(type == "BPE", "tokenizer",
              "{}: model type '{}' is not supported; hint: weave reads BPE tokenizers (byte-level "
              "as GPT-2, Llama 3 and Qwen; SentencePiece-style as Llama 2 and Gemma), not {} ones",
              path, type, type);
  for (const char* affix : {"continuing_subword_prefix", "end_of_word_suffix"})
    WEAVE_CHECK(model.value(affix, json()).is_null() || model[affix] == "", "tokenizer",
                "{}: a BPE model with {} {} is not supported", path, affix, model[affix].dump());
  WEAVE_CHECK(model.value("dropout", json()).is_null(), "tokenizer",
              "{}: BPE dropout is not supported (it samples encodings while training)", path);
  impl.ignore_merges = model.value("ignore_merges", false);
  impl.byte_fallback = model.value("byte_fallback", false);
  impl.fuse_unknown = model.value("fuse_unk", false);
  WEAVE_CHECK(!impl.byte_level || !impl.byte_fallback, "tokenizer",
              "{}: a byte-level BPE model (ByteLevel pre-tokenizer) with byte_fallback", path);
}

Tokenizer::Impl read_tokenizer_json(const json& root, const std::string& path) {
  Tokenizer::Impl impl;
  const json& model = root.at("model");
  impl.pipeline = read_text_pipeline(root.value("normalizer", json()),
                                     root.value("pre_tokenizer", json()), path, impl.byte_level);
  impl.decoder = read_decoder(root.value("decoder", json()), path);
  WEAVE_CHECK(impl.decoder.byte_level == impl.byte_level || root.value("decoder", json()).is_null(),
              "tokenizer", "{}: the decoder {} ByteLevel and the pre-tokenizer {}", path,
              impl.decoder.byte_level ? "is" : "is not", impl.byte_level ? "is" : "is not");
  read_model_options(model, impl, path);
  impl.add_vocab(model.at("vocab"), path.c_str());
  if (const json unk = model.value("unk_token", json()); unk.is_string()) {
    const auto found = impl.vocab.find(unk.get<std::string>());
    WEAVE_CHECK(found != impl.vocab.end(), "tokenizer", "{}: unk_token {} is not in the vocabulary",
                path, unk.dump());
    impl.unknown = found->second;
  }
  read_merges(model.at("merges"), impl, path);
  if (!impl.byte_level) impl.find_word_starts();
  read_added_tokens(root.value("added_tokens", json::array()), impl, path);
  read_post_processor(root.value("post_processor", json()), impl, path);
  for (const auto& [key, field] : {std::pair{"normalizer", &impl.normalizer_json},
                                   {"pre_tokenizer", &impl.pre_tokenizer_json},
                                   {"decoder", &impl.decoder_json},
                                   {"post_processor", &impl.post_processor_json}})
    *field = root.value(key, json()).dump();
  return impl;
}

json byte_level(bool add_prefix_space, bool use_regex) {
  return {{"type", "ByteLevel"},
          {"add_prefix_space", add_prefix_space},
          {"trim_offsets", true},
          {"use_regex", use_regex}};
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

// A part as read, or (GPT-2's files) what byte-level BPE with GPT-2's split writes.
json part(const std::string& read, json otherwise) {
  return read.empty() ? std::move(otherwise) : json::parse(read);
}

json model_of(const Tokenizer::Impl& impl) {
  json vocab = json::object();
  for (const auto& [key, id] : impl.vocab) vocab[impl.file_text(key)] = id;
  std::vector<std::pair<int32_t, uint64_t>> by_rank;  // (rank, pair key)
  for (const auto& [key, merge] : impl.merges) by_rank.emplace_back(merge.rank, key);
  std::sort(by_rank.begin(), by_rank.end());
  std::vector<std::string> text_of(impl.token_bytes.size());
  for (const auto& [key, id] : impl.vocab) text_of[size_t(id)] = impl.file_text(key);
  json merges = json::array();
  for (const auto& [rank, key] : by_rank) {
    const std::string &left = text_of[key >> 32], &right = text_of[key & 0xFFFFFFFFu];
    // "left right", as every tokenizers release reads, unless a side holds a space.
    if (left.find(' ') == std::string::npos && right.find(' ') == std::string::npos)
      merges.push_back(left + " " + right);
    else
      merges.push_back({left, right});
  }
  json unk = nullptr;
  if (impl.unknown >= 0) unk = text_of[size_t(impl.unknown)];
  return {{"type", "BPE"},
          {"dropout", nullptr},
          {"unk_token", unk},
          {"continuing_subword_prefix", nullptr},
          {"end_of_word_suffix", nullptr},
          {"fuse_unk", impl.fuse_unknown},
          {"byte_fallback", impl.byte_fallback},
          {"ignore_merges", impl.ignore_merges},
          {"vocab", vocab},
          {"merges", merges}};
}

// A token given by name ("<s>", or {"content": "<s>", ...}) in tokenizer_config.json.
std::optional<int32_t> config_token(const Tokenizer& tok, const json& config, const char* key) {
  const json value = config.value(key, json());
  const json name = value.is_object() ? value.value("content", json()) : value;
  if (!name.is_string()) return std::nullopt;
  return tok.token_id(name.get<std::string>());
}

}  // namespace

std::string Tokenizer::hf_json() const {
  const Impl& impl = *impl_;
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
                     {"normalizer", part(impl.normalizer_json, nullptr)},
                     {"pre_tokenizer", part(impl.pre_tokenizer_json, byte_level(false, true))},
                     {"post_processor", post_processor_of(impl)},
                     {"decoder", part(impl.decoder_json, byte_level(true, true))},
                     {"model", model_of(impl)}};
  return root.dump(2);
}

void Tokenizer::save_pretrained(const std::string& dir) const {
  std::filesystem::create_directories(dir);
  write_file_atomically(dir + "/tokenizer.json", hf_json());
  // The special tokens transformers looks for by role: end-of-text as eos (and as bos where the
  // model has no beginning-of-text token of its own, as GPT-2's files say).
  json roles = json::object();
  const std::optional<int32_t> eos = end_of_text();
  std::optional<int32_t> bos = begin_of_text();
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
  try {
    return Tokenizer(std::make_unique<Impl>(read_tokenizer_json(root, path)));
  } catch (const json::exception& e) {
    WEAVE_FAIL("tokenizer", "{} is not a tokenizer.json weave can read: {}", path, e.what());
  }
}

void Tokenizer::read_special_token_files(const std::string& dir) {
  namespace fs = std::filesystem;
  const auto parse = [](const fs::path& file) {
    try {
      return json::parse(read_file(file.string()));
    } catch (const json::exception& e) {
      WEAVE_FAIL("tokenizer", "{} is not valid JSON: {}", file.string(), e.what());
    }
  };
  if (const fs::path file = fs::path(dir) / "tokenizer_config.json"; fs::exists(file)) {
    const json config = parse(file);
    if (auto bos = config_token(*this, config, "bos_token")) impl_->bos = bos;
    if (auto eos = config_token(*this, config, "eos_token")) impl_->eos = eos;
  }
  if (const fs::path file = fs::path(dir) / "generation_config.json"; fs::exists(file)) {
    const json config = parse(file);
    const auto id_of = [&](const json& id) {
      const int32_t value = Impl::id_from(id, "generation_config.json", file.c_str());
      WEAVE_CHECK(value < vocab_size(), "tokenizer", "{} names token id {}, past the vocabulary",
                  file.string(), value);
      return value;
    };
    if (const json bos = config.value("bos_token_id", json()); !bos.is_null())
      impl_->bos = id_of(bos);
    const json eos = config.value("eos_token_id", json());
    impl_->stop_ids.clear();
    for (const json& id : eos.is_array() ? eos : json::array({eos}))
      if (!id.is_null()) impl_->stop_ids.push_back(id_of(id));
    if (!impl_->stop_ids.empty()) impl_->eos = impl_->stop_ids[0];
  }
}

}  // namespace weave::data

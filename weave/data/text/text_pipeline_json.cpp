// tokenizer.json's normalizer, pre_tokenizer and decoder: every type and option weave implements
// is read; anything else raises, naming the field, rather than encode differently from the model.
#include "weave/data/text/text_pipeline.h"
#include "weave/tensor/error.h"

#include <nlohmann/json.hpp>

namespace weave::data {
namespace {

using json = nlohmann::json;

std::string brief(const json& value) {
  return value.dump().substr(0, 160);
}

// A pattern given as {"String": ...}; {"Regex": ...} only where `regex` is allowed.
std::string string_pattern(const json& step, const std::string& path) {
  const json& pattern = step.at("pattern");
  WEAVE_CHECK(pattern.contains("String"), "tokenizer",
              "{}: {} has a {} pattern; hint: weave replaces literal strings only", path,
              step.value("type", ""), pattern.contains("Regex") ? "Regex" : "missing");
  return pattern.at("String").get<std::string>();
}

void read_normalizer(const json& n, const std::string& path, std::vector<NormalizerStep>& out) {
  if (n.is_null()) return;
  const std::string type = n.value("type", "");
  if (type == "Sequence") {
    for (const json& step : n.at("normalizers")) read_normalizer(step, path, out);
    return;
  }
  static const std::pair<const char*, unicode::Form> forms[] = {{"NFC", unicode::Form::kNFC},
                                                                {"NFD", unicode::Form::kNFD},
                                                                {"NFKC", unicode::Form::kNFKC},
                                                                {"NFKD", unicode::Form::kNFKD}};
  for (const auto& [name, form] : forms)
    if (type == name) {
      out.emplace_back(NormalizerStep::kUnicode).form = form;
      return;
    }
  if (type == "Replace") {
    NormalizerStep& step = out.emplace_back(NormalizerStep::kReplace);
    step.pattern = string_pattern(n, path);
    step.content = n.at("content").get<std::string>();
    return;
  }
  if (type == "Prepend") {
    out.emplace_back(NormalizerStep::kPrepend).content = n.at("prepend").get<std::string>();
    return;
  }
  if (type == "Strip") {
    NormalizerStep& step = out.emplace_back(NormalizerStep::kStrip);
    step.strip_left = n.value("strip_left", false);
    step.strip_right = n.value("strip_right", false);
    return;
  }
  WEAVE_FAIL("tokenizer",
             "{}: normalizer {} is not supported; hint: weave implements NFC, NFD, NFKC, NFKD, "
             "Replace (of a string), Prepend, Strip and Sequence",
             path, brief(n));
}

SplitBehavior behavior_of(const json& step, const std::string& path) {
  const std::string name = step.value("behavior", "Isolated");
  static const std::pair<const char*, SplitBehavior> known[] = {
      {"Isolated", SplitBehavior::kIsolated},
      {"Removed", SplitBehavior::kRemoved},
      {"MergedWithPrevious", SplitBehavior::kMergedWithPrevious},
      {"MergedWithNext", SplitBehavior::kMergedWithNext},
      {"Contiguous", SplitBehavior::kContiguous}};
  for (const auto& [text, behavior] : known)
    if (name == text) return behavior;
  WEAVE_FAIL("tokenizer", "{}: Split behavior '{}' is not one of Hugging Face's", path, name);
}

PreTokenizerStep split_step(const json& p, const std::string& path) {
  WEAVE_CHECK(!p.value("invert", false), "tokenizer",
              "{}: a Split with invert true is not supported: {}", path, brief(p));
  const json& pattern = p.at("pattern");
  PreTokenizerStep step(PreTokenizerStep::kSplit);
  step.behavior = behavior_of(p, path);
  if (pattern.contains("Regex")) {
    step.pattern = SplitPattern::compile(pattern.at("Regex").get<std::string>());
  } else {
    step.kind = PreTokenizerStep::kSplitString;
    step.literal = string_pattern(p, path);
  }
  return step;
}

PreTokenizerStep metaspace_step(const json& p, const std::string& path) {
  PreTokenizerStep step(PreTokenizerStep::kMetaspace);
  step.literal = p.value("replacement", "\u2581");
  const std::string scheme = p.value("prepend_scheme", "");
  if (scheme.empty())  // files before prepend_scheme: add_prefix_space says always or never
    step.prepend = p.value("add_prefix_space", true) ? PreTokenizerStep::Prepend::kAlways
                                                     : PreTokenizerStep::Prepend::kNever;
  else if (scheme == "always")
    step.prepend = PreTokenizerStep::Prepend::kAlways;
  else if (scheme == "first")
    step.prepend = PreTokenizerStep::Prepend::kFirst;
  else if (scheme == "never")
    step.prepend = PreTokenizerStep::Prepend::kNever;
  else
    WEAVE_FAIL("tokenizer", "{}: Metaspace prepend_scheme '{}' is unknown", path, scheme);
  step.metaspace_split = p.value("split", true);
  return step;
}

void read_pre_tokenizer(const json& p, const std::string& path,
                        std::vector<PreTokenizerStep>& out) {
  if (p.is_null()) return;
  const std::string type = p.value("type", "");
  if (type == "Sequence") {
    for (const json& step : p.at("pretokenizers")) read_pre_tokenizer(step, path, out);
    return;
  }
  if (type == "Split") return out.push_back(split_step(p, path));
  if (type == "Metaspace") {
    WEAVE_CHECK(out.empty(), "tokenizer", "{}: Metaspace after another pre-tokenizer step", path);
    return out.push_back(metaspace_step(p, path));
  }
  WEAVE_CHECK(type == "ByteLevel", "tokenizer",
              "{}: pre_tokenizer {} is not supported; hint: weave implements Split, ByteLevel, "
              "Metaspace and Sequence",
              path, brief(p));
  PreTokenizerStep step(PreTokenizerStep::kByteLevel);
  step.add_prefix_space = p.value("add_prefix_space", false);
  WEAVE_CHECK(!step.add_prefix_space || out.empty(), "tokenizer",
              "{}: a ByteLevel pre-tokenizer with add_prefix_space after a Split (a space before "
              "each piece) is not supported",
              path);
  if (p.value("use_regex", true)) step.pattern = SplitPattern::gpt2();
  out.push_back(std::move(step));
}

void read_decoder_step(const json& d, const std::string& path, DecoderSpec& spec, bool& fused) {
  const std::string type = d.value("type", "");
  if (type == "Sequence") {
    for (const json& step : d.at("decoders")) read_decoder_step(step, path, spec, fused);
  } else if (type == "ByteLevel") {
    spec.byte_level = true;
  } else if (type == "Replace") {
    spec.replace.emplace_back(string_pattern(d, path), d.at("content").get<std::string>());
  } else if (type == "ByteFallback") {
    spec.byte_fallback = true;
  } else if (type == "Fuse") {
    fused = true;
  } else if (type == "Strip" && fused) {
    WEAVE_CHECK(d.value("content", " ") == " ", "tokenizer",
                "{}: a Strip decoder of '{}' (weave strips spaces)", path, d.value("content", ""));
    spec.strip_start += d.value("start", size_t(0));
    spec.strip_stop += d.value("stop", size_t(0));
  } else if (type == "Metaspace") {
    spec.replace.emplace_back(d.value("replacement", "\u2581"), " ");
    const bool prefix =
        d.value("prepend_scheme",
                std::string(d.value("add_prefix_space", true) ? "always" : "never")) != "never";
    spec.strip_start += prefix ? 1 : 0;
  } else {
    WEAVE_FAIL("tokenizer",
               "{}: decoder {} is not supported; hint: weave implements ByteLevel, Metaspace, and "
               "Replace, ByteFallback, Fuse and Strip (after Fuse) in a Sequence",
               path, brief(d));
  }
}

}  // namespace

TextPipeline read_text_pipeline(const json& normalizer, const json& pre, const std::string& path,
                                bool& byte_level) {
  TextPipeline pipeline;
  read_normalizer(normalizer, path, pipeline.normalizers);
  read_pre_tokenizer(pre, path, pipeline.pre_tokenizers);
  byte_level = false;
  for (const PreTokenizerStep& step : pipeline.pre_tokenizers)
    byte_level = byte_level || step.kind == PreTokenizerStep::kByteLevel;
  return pipeline;
}

DecoderSpec read_decoder(const json& decoder, const std::string& path) {
  DecoderSpec spec;
  if (decoder.is_null()) return spec;
  bool fused = false;
  read_decoder_step(decoder, path, spec, fused);
  return spec;
}

}  // namespace weave::data

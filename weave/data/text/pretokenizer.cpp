// The matcher of split patterns: a backtracking machine over the compiled program (leftmost-first
// and greedy, as Rust's regex crate and Python's regex module find), tried branch by branch at
// each position, skipping the branches that cannot start with an ASCII character.
#include "weave/data/text/pretokenizer.h"
#include "weave/data/text/split_pattern.h"
#include "weave/data/text/unicode.h"

#include <unordered_set>

namespace weave::data {
namespace {

using Program = SplitPattern::Program;
constexpr size_t kNoMatch = SIZE_MAX;

// A state of the machine in one run: which run (the outer one, or a look-ahead's), where in the
// program, where in the text.
struct State {
  uint64_t run;
  int32_t pc;
  size_t pos;
  bool operator==(const State&) const = default;
};
struct StateHash {
  size_t operator()(const State& s) const {
    return std::hash<uint64_t>{}(s.run * 0x9E3779B97F4A7C15ull ^ uint64_t(s.pc) << 40 ^ s.pos);
  }
};

class Machine {
 public:
  Machine(const Program& program, std::string_view text) : p_(program), text_(text) {}

  // Where the program from `pc` ends a match starting at `pos`, or kNoMatch. Past kRemember
  // steps a run remembers the states it has been in: a state met again has failed already (no
  // loop can come back to a state without reading a character), so a pattern that would
  // backtrack exponentially ((?:a|a)(?:a|a)...) takes at most program x text steps.
  size_t run(int32_t pc, size_t pos) {
    constexpr size_t kRemember = 4096;
    const size_t base = stack_.size();
    const uint64_t this_run = ++runs_;
    size_t steps = 0;
    for (;;) {
      if (++steps > kRemember && !seen_.insert({this_run, pc, pos}).second) {
        if (stack_.size() == base) return kNoMatch;
        pc = stack_.back().first;
        pos = stack_.back().second;
        stack_.pop_back();
        continue;
      }
      const Program::Instruction& in = p_.code[size_t(pc)];
      switch (in.op) {
        case Program::kSet:
          if (pos < text_.size()) {
            const unicode::Char c = unicode::char_at(text_, pos);
            if (p_.sets[size_t(in.x)].contains(c.code, unicode::classes_of(c.code))) {
              pos += c.size;
              ++pc;
              continue;
            }
          }
          break;
        case Program::kSplit:
          stack_.push_back({in.y, pos});
          pc = in.x;
          continue;
        case Program::kJump:
          pc = in.x;
          continue;
        case Program::kLookahead:
        case Program::kNotLookahead:
          if ((run(in.x, pos) != kNoMatch) == (in.op == Program::kLookahead)) {
            pc = in.y;
            continue;
          }
          break;
        case Program::kMatch:
          stack_.resize(base);
          return pos;
      }
      if (stack_.size() == base) return kNoMatch;
      pc = stack_.back().first;
      pos = stack_.back().second;
      stack_.pop_back();
    }
  }

  // The end of the first branch's match at i, or kNoMatch (an empty match counts as none).
  size_t match_at(size_t i) {
    if (!seen_.empty()) seen_.clear();
    const auto lead = uint8_t(text_[i]);
    for (const Program::Branch& branch : p_.branches) {
      if (lead < 128 && !branch.may_start_ascii[lead]) continue;
      const size_t end = run(branch.start, i);
      if (end != kNoMatch && end > i) return end;
    }
    return kNoMatch;
  }

 private:
  const Program& p_;
  std::string_view text_;
  std::vector<std::pair<int32_t, size_t>> stack_;
  std::unordered_set<State, StateHash> seen_;
  uint64_t runs_ = 0;
};

}  // namespace

SplitPattern::SplitPattern(std::shared_ptr<const Program> program) : program_(std::move(program)) {}
SplitPattern::SplitPattern(SplitPattern&&) noexcept = default;
SplitPattern& SplitPattern::operator=(SplitPattern&&) noexcept = default;
SplitPattern::SplitPattern(const SplitPattern&) = default;
SplitPattern& SplitPattern::operator=(const SplitPattern&) = default;
SplitPattern::~SplitPattern() = default;

SplitPattern SplitPattern::compile(std::string pattern) {
  return SplitPattern(std::make_shared<const Program>(compile_split_pattern(std::move(pattern))));
}

const SplitPattern& SplitPattern::gpt2() {
  static const SplitPattern pattern =
      compile(R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)");
  return pattern;
}

const SplitPattern& SplitPattern::llama3() {
  static const SplitPattern pattern = compile(
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)");
  return pattern;
}

const std::string& SplitPattern::source() const {
  return program_->source;
}

void SplitPattern::split(std::string_view text, std::vector<std::string_view>& pieces,
                         std::vector<bool>* matched) const {
  Machine machine(*program_, text);
  size_t gap = 0;  // where the text no match has taken starts
  for (size_t i = 0; i < text.size();) {
    const size_t end = machine.match_at(i);
    if (end == kNoMatch) {
      i += unicode::char_at(text, i).size;
      continue;
    }
    if (gap < i) pieces.push_back(text.substr(gap, i - gap));
    if (gap < i && matched) matched->push_back(false);
    pieces.push_back(text.substr(i, end - i));
    if (matched) matched->push_back(true);
    i = gap = end;
  }
  if (gap < text.size()) pieces.push_back(text.substr(gap));
  if (gap < text.size() && matched) matched->push_back(false);
}

}  // namespace weave::data

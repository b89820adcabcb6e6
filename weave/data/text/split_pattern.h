#pragma once
// The compiled form of a SplitPattern, shared by the parser (split_pattern_parse.cpp) and the
// matcher (pretokenizer.cpp): character sets and a program for a backtracking machine, one entry
// point for each branch of the top-level alternation.
#include "weave/data/text/pretokenizer.h"

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace weave::data {

struct CharSet {
  std::vector<std::pair<char32_t, char32_t>> ranges;  // literal characters and a-z ranges
  uint16_t classes = 0;                               // \p{X}: in any of these
  std::vector<uint16_t> not_classes;                  // \P{X}: outside one of these
  bool negated = false;                               // [^...]

  bool contains(char32_t code, uint16_t classes_of_code) const {
    bool in = (classes & classes_of_code) != 0;
    for (size_t i = 0; !in && i < not_classes.size(); ++i)
      in = (not_classes[i] & classes_of_code) == 0;
    for (size_t i = 0; !in && i < ranges.size(); ++i)
      in = code >= ranges[i].first && code <= ranges[i].second;
    return in != negated;
  }
};

struct SplitPattern::Program {
  enum Op : uint8_t {
    kSet,           // one character of sets[x]
    kSplit,         // try x, then y
    kJump,          // go to x
    kLookahead,     // the program at x matches here (zero width); then go to y
    kNotLookahead,  // the program at x does not match here; then go to y
    kMatch,
  };
  struct Instruction {
    Op op;
    int32_t x = 0, y = 0;
  };
  struct Branch {
    int32_t start;
    std::array<bool, 128> may_start_ascii;  // false: this branch cannot match at that character
  };
  std::string source;
  std::vector<CharSet> sets;
  std::vector<Instruction> code;
  std::vector<Branch> branches;
};

/// Parses and compiles a pattern (split_pattern_parse.cpp).
SplitPattern::Program compile_split_pattern(std::string pattern);

}  // namespace weave::data

// Reads a split pattern into a program: a recursive-descent parser over the pattern's code points
// builds a small syntax tree, which compiles to the backtracking machine's instructions.
#include "weave/data/text/split_pattern.h"
#include "weave/data/text/unicode.h"
#include "weave/tensor/error.h"

#include <cctype>
#include <climits>

namespace weave::data {
namespace {

using Program = SplitPattern::Program;

struct Node {
  enum Kind { kSet, kAlternation, kSequence, kRepeat, kLookahead } kind;
  explicit Node(Kind k, int32_t set_index = -1) : kind(k), set(set_index) {}
  int32_t set;
  std::vector<Node> children;
  int32_t min = 1, max = 1;  // kRepeat; max INT32_MAX: no bound
  bool negative = false;     // kLookahead
};

struct ClassName {
  const char* name;
  uint16_t classes;
};
constexpr ClassName kClassNames[] = {
    {"L", unicode::kLetter},       {"N", unicode::kNumber},         {"Lu", unicode::kUpper},
    {"Ll", unicode::kLower},       {"Lt", unicode::kTitle},         {"Lm", unicode::kModifier},
    {"Lo", unicode::kOtherLetter}, {"M", unicode::kMark},           {"P", unicode::kPunctuation},
    {"S", unicode::kSymbol},       {"Nd", unicode::kDigit},         {"Letter", unicode::kLetter},
    {"Number", unicode::kNumber},  {"White_Space", unicode::kSpace}};

class Parser {
 public:
  explicit Parser(std::string source) : source_(std::move(source)) {
    for (size_t i = 0; i < source_.size();) {
      const unicode::Char c = unicode::char_at(source_, i);
      fail_unless(c.code != unicode::kInvalid, "is not valid UTF-8");
      text_.push_back(c.code);
      i += c.size;
    }
  }

  Node parse() {
    Node top = alternation(false);
    fail_unless(done(), "has a ')' without its '('");
    return top;
  }
  std::vector<CharSet> sets;

 private:
  bool done() const { return at_ >= text_.size(); }
  char32_t peek(size_t ahead = 0) const {
    return at_ + ahead < text_.size() ? text_[at_ + ahead] : 0;
  }
  char32_t next() {
    fail_unless(!done(), "ends in the middle of an expression");
    return text_[at_++];
  }
  bool accept(char32_t c) {
    if (peek() != c || done()) return false;
    ++at_;
    return true;
  }
  void fail_unless(bool ok, const char* what) const {
    WEAVE_CHECK(ok, "tokenizer",
                "the split pattern {} {} (at character {}); hint: weave reads alternations of "
                "character classes with ?, *, +, {{n,m}}, (?:...), (?i:...) and look-ahead",
                source_, what, at_);
  }

  Node alternation(bool icase) {
    Node alt(Node::kAlternation);
    alt.children.push_back(sequence(icase));
    while (accept('|')) alt.children.push_back(sequence(icase));
    return alt.children.size() == 1 ? std::move(alt.children[0]) : alt;
  }

  Node sequence(bool icase) {
    Node seq(Node::kSequence);
    while (!done() && peek() != '|' && peek() != ')') seq.children.push_back(quantified(icase));
    return seq;
  }

  Node quantified(bool icase) {
    Node atom_node = atom(icase);
    int32_t min = 1, max = 1;
    if (accept('?'))
      min = 0;
    else if (accept('*'))
      min = 0, max = INT32_MAX;
    else if (accept('+'))
      max = INT32_MAX;
    else if (peek() == '{')
      bounds(min, max);
    else
      return atom_node;
    fail_unless(peek() != '?' && peek() != '+', "has a lazy or possessive quantifier");
    fail_unless(atom_node.kind == Node::kSet || max == 1,
                "repeats a group (only single characters and classes repeat)");
    Node repeat(Node::kRepeat);
    repeat.min = min, repeat.max = max;
    repeat.children.push_back(std::move(atom_node));
    return repeat;
  }

  void bounds(int32_t& min, int32_t& max) {
    next();  // {
    const auto number = [&] {
      fail_unless(peek() >= '0' && peek() <= '9', "has a '{' without a count");
      int32_t n = 0;
      while (peek() >= '0' && peek() <= '9' && n < 100000) n = n * 10 + int32_t(next() - '0');
      return n;
    };
    min = max = number();
    if (accept(',')) max = peek() == '}' ? INT32_MAX : number();
    fail_unless(accept('}') && min <= max, "has a bad {n,m}");
    // Counted repeats are written out: a bound past 1000 (as RE2's) would make a huge program.
    fail_unless(min <= 1000 && (max <= 1000 || max == INT32_MAX), "repeats more than 1000 times");
  }

  int32_t add_set(CharSet set) {
    sets.push_back(std::move(set));
    return int32_t(sets.size() - 1);
  }
  Node set_node(CharSet set) { return Node(Node::kSet, add_set(std::move(set))); }

  Node atom(bool icase) {
    const char32_t c = next();
    if (c == '(') return group(icase);
    if (c == '[') return set_node(bracket(icase));
    if (c == '.') return set_node(CharSet{{{'\n', '\n'}}, 0, {}, true});
    fail_unless(c != '^' && c != '$', "has an anchor");
    fail_unless(c != '*' && c != '+' && c != '?' && c != '{',
                "has a quantifier with nothing before");
    CharSet set;
    if (c == '\\')
      escape(set, icase);
    else
      add_char(set, c, icase);
    return set_node(std::move(set));
  }

  Node group(bool icase) {
    constexpr int kMaxDepth = 64;  // the parser and the machine recurse once a level
    fail_unless(++depth_ <= kMaxDepth, "nests groups more than 64 deep");
    Node inner = group_body(icase);
    --depth_;
    return inner;
  }

  Node group_body(bool icase) {
    Node look(Node::kLookahead);
    if (accept('?')) {
      const char32_t kind = next();
      if (kind == '!' || kind == '=') {
        look.negative = kind == '!';
        look.children.push_back(alternation(icase));
        fail_unless(accept(')'), "has a '(' without its ')'");
        return look;
      }
      if (kind == 'i')
        icase = true;
      else
        fail_unless(kind == ':', "has a group kind other than (?:, (?i:, (?! and (?=");
      if (kind == 'i') fail_unless(accept(':'), "has flags other than (?i:");
    }
    Node inner = alternation(icase);
    fail_unless(accept(')'), "has a '(' without its ')'");
    return inner;
  }

  // A character, with its other cases under (?i) as Unicode's simple case folding has them for
  // ASCII letters (and U+017F, the long s, for s; U+212A, the Kelvin sign, for k).
  static void add_char(CharSet& set, char32_t c, bool icase) {
    set.ranges.push_back({c, c});
    if (!icase) return;
    const char32_t lower = c >= 'A' && c <= 'Z' ? c + 32 : c;
    if (lower < 'a' || lower > 'z') return;
    set.ranges.push_back({lower, lower});
    set.ranges.push_back({lower - 32, lower - 32});
    if (lower == 's') set.ranges.push_back({0x17F, 0x17F});
    if (lower == 'k') set.ranges.push_back({0x212A, 0x212A});
  }

  CharSet bracket(bool icase) {
    CharSet set;
    set.negated = accept('^');
    bool first = true;
    while (first || peek() != ']') {
      fail_unless(!done(), "has a '[' without its ']'");
      first = false;
      char32_t c = next();
      const bool escaped = c == '\\';
      if (escaped) {
        CharSet inner;
        escape(inner, false);
        set.classes |= inner.classes;
        set.not_classes.insert(set.not_classes.end(), inner.not_classes.begin(),
                               inner.not_classes.end());
        if (inner.ranges.size() != 1) continue;  // a class: \p{L}, \s, ...
        c = inner.ranges[0].first;
      }
      fail_unless(escaped || c != '[', "has a nested class or a set operation");
      if (peek() == '-' && peek(1) != ']') {
        next();
        char32_t last = next();
        if (last == '\\') {
          CharSet inner;
          escape(inner, false);
          fail_unless(inner.ranges.size() == 1, "has a range to a class");
          last = inner.ranges[0].first;
        }
        fail_unless(c <= last, "has a range backwards");
        set.ranges.push_back({c, last});
        continue;
      }
      add_char(set, c, icase);
    }
    next();  // ]
    return set;
  }

  char32_t hex(size_t max_digits, bool braced) {
    char32_t value = 0;
    size_t digits = 0;
    for (; digits < max_digits && peek() < 128 && std::isxdigit(int(peek())); ++digits) {
      const char32_t d = next();
      value = value * 16 + char32_t(d <= '9' ? d - '0' : (d | 0x20) - 'a' + 10);
    }
    fail_unless(digits > 0 && value <= 0x10FFFF, "has a bad hexadecimal escape");
    if (braced) fail_unless(accept('}'), "has a '\\x{' without its '}'");
    return value;
  }

  void escape(CharSet& set, bool icase) {
    const char32_t c = next();
    const auto property = [&](bool negated) {
      fail_unless(accept('{'), "has \\p without {...}");
      std::string name;
      while (!done() && peek() != '}') name.push_back(char(next()));
      fail_unless(accept('}'), "has a '\\p{' without its '}'");
      for (const ClassName& known : kClassNames)
        if (name == known.name) {
          if (negated)
            set.not_classes.push_back(known.classes);
          else
            set.classes |= known.classes;
          return;
        }
      fail_unless(false,
                  "names a Unicode class weave does not know (\\p{L, N, Lu, Ll, Lt, Lm, "
                  "Lo, M, P, S, Nd} are known)");
    };
    switch (c) {
      case 'p':
        return property(false);
      case 'P':
        return property(true);
      case 's':
        set.classes |= unicode::kSpace;
        return;
      case 'S':
        set.not_classes.push_back(unicode::kSpace);
        return;
      case 'd':
        set.classes |= unicode::kDigit;
        return;
      case 'D':
        set.not_classes.push_back(unicode::kDigit);
        return;
      case 'r':
        return add_char(set, '\r', false);
      case 'n':
        return add_char(set, '\n', false);
      case 't':
        return add_char(set, '\t', false);
      case 'f':
        return add_char(set, '\f', false);
      case 'v':
        return add_char(set, '\v', false);
      case 'x':
        return add_char(set, accept('{') ? hex(6, true) : hex(2, false), icase);
      case 'u':
        return add_char(set, accept('{') ? hex(6, true) : hex(4, false), icase);
      default:
        fail_unless(c < 128 && !std::isalnum(int(c)),
                    "has an escape weave does not read (\\w, \\b, back-references)");
        add_char(set, c, icase);
    }
  }

  std::string source_;
  std::vector<char32_t> text_;
  size_t at_ = 0;
  int depth_ = 0;
};

class Compiler {
 public:
  explicit Compiler(Program& program) : p_(program) {}

  int32_t emit(Program::Op op, int32_t x = 0, int32_t y = 0) {
    WEAVE_CHECK(p_.code.size() < (size_t(1) << 20), "tokenizer",
                "the split pattern {} compiles to more than 2^20 instructions; hint: fewer or "
                "smaller counted repeats",
                p_.source.substr(0, 200));
    p_.code.push_back({op, x, y});
    return int32_t(p_.code.size() - 1);
  }
  int32_t here() const { return int32_t(p_.code.size()); }

  void compile(const Node& node) {
    switch (node.kind) {
      case Node::kSet:
        emit(Program::kSet, node.set);
        return;
      case Node::kSequence:
        for (const Node& child : node.children) compile(child);
        return;
      case Node::kAlternation:
        return alternation(node);
      case Node::kRepeat:
        return repeat(node);
      case Node::kLookahead: {
        const int32_t look = emit(node.negative ? Program::kNotLookahead : Program::kLookahead);
        p_.code[size_t(look)].x = here();
        compile(node.children[0]);
        emit(Program::kMatch);
        p_.code[size_t(look)].y = here();
        return;
      }
    }
  }

 private:
  void alternation(const Node& node) {
    std::vector<int32_t> jumps;
    for (size_t i = 0; i < node.children.size(); ++i) {
      int32_t split = -1;
      if (i + 1 < node.children.size()) split = emit(Program::kSplit, here() + 1);
      compile(node.children[i]);
      if (i + 1 < node.children.size()) {
        jumps.push_back(emit(Program::kJump));
        p_.code[size_t(split)].y = here();
      }
    }
    for (int32_t jump : jumps) p_.code[size_t(jump)].x = here();
  }

  void repeat(const Node& node) {
    const Node& body = node.children[0];
    for (int32_t i = 0; i < node.min; ++i) compile(body);
    if (node.max == INT32_MAX) {  // greedy star: L: split(body, out); body; jump L
      const int32_t loop = emit(Program::kSplit, here() + 1);
      compile(body);
      emit(Program::kJump, loop);
      p_.code[size_t(loop)].y = here();
      return;
    }
    std::vector<int32_t> splits;
    for (int32_t i = node.min; i < node.max; ++i) {
      splits.push_back(emit(Program::kSplit, here() + 1));
      compile(body);
    }
    for (int32_t split : splits) p_.code[size_t(split)].y = here();
  }

  Program& p_;
};

// Whether a match of `node` may begin with the character (false: it cannot), and whether it
// may match nothing at all.
bool may_start(const Node& node, const std::vector<CharSet>& sets, char32_t c, uint16_t cls,
               bool& nullable) {
  switch (node.kind) {
    case Node::kSet:
      nullable = false;
      return sets[size_t(node.set)].contains(c, cls);
    case Node::kLookahead:
      nullable = true;
      return false;
    case Node::kRepeat: {
      const bool starts = may_start(node.children[0], sets, c, cls, nullable);
      nullable = nullable || node.min == 0;
      return starts;
    }
    case Node::kAlternation: {
      bool any = false, any_nullable = false;
      for (const Node& child : node.children) {
        bool child_nullable = false;
        any = may_start(child, sets, c, cls, child_nullable) || any;
        any_nullable = any_nullable || child_nullable;
      }
      nullable = any_nullable;
      return any;
    }
    case Node::kSequence:
      for (const Node& child : node.children) {
        bool child_nullable = false;
        if (may_start(child, sets, c, cls, child_nullable)) return nullable = false, true;
        if (!child_nullable) return nullable = false, false;
      }
      nullable = true;
      return false;
  }
  return true;
}

}  // namespace

Program compile_split_pattern(std::string pattern) {
  Program program;
  program.source = pattern;
  Parser parser(std::move(pattern));
  const Node top = parser.parse();
  program.sets = std::move(parser.sets);
  const std::vector<Node> branches =
      top.kind == Node::kAlternation ? top.children : std::vector<Node>{top};
  Compiler compiler(program);
  for (const Node& branch : branches) {
    Program::Branch entry{compiler.here(), {}};
    for (char32_t c = 0; c < 128; ++c) {
      bool nullable = false;
      entry.may_start_ascii[c] =
          may_start(branch, program.sets, c, unicode::classes_of(c), nullable) || nullable;
    }
    compiler.compile(branch);
    compiler.emit(Program::kMatch);
    program.branches.push_back(entry);
  }
  return program;
}

}  // namespace weave::data

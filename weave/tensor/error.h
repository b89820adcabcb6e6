#pragma once
// weave::Error and the checking macros every layer uses.
//
// Messages start with the operation in brackets and say what was expected, what was
// found, and (when useful) a hint: "[matmul] inner dimensions differ: lhs [4, 6] vs rhs [5, 3]".
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <stdexcept>
#include <string>

namespace weave {

/// The one exception type weave throws for bad input and backend failures.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

namespace detail {
[[noreturn]] void throw_error(std::string message);
}  // namespace detail

}  // namespace weave

/// Throws weave::Error("[op] " + formatted message); the message must be a string literal.
#define WEAVE_FAIL(op, message, ...) \
  ::weave::detail::throw_error(fmt::format("[{}] " message, op, ##__VA_ARGS__))

/// Throws weave::Error("[op] ...") unless cond holds.
#define WEAVE_CHECK(cond, op, ...)                                 \
  do {                                                             \
    if (__builtin_expect(!(cond), 0)) WEAVE_FAIL(op, __VA_ARGS__); \
  } while (0)

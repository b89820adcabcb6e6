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

/// The message of the last weave::Error raised in this process ("" if none), for the report a
/// rank prints when it has to abort a distributed job.
std::string last_error_message();

namespace detail {
[[noreturn]] void throw_error(std::string message);
/// Raises "[op] call failed: error" (what WEAVE_CHECK_CALL reports).
[[noreturn]] void fail_call(const char* op, const char* call, const std::string& error);
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

/// Checks the status a CUDA, cuBLAS, NCCL or MPI call returns; on failure raises
/// weave::Error("[op] cudaMalloc(&ptr, size) failed: out of memory (CUDA
/// cudaErrorMemoryAllocation)"). The status type selects the library through two overloads in
/// weave::detail that each backend defines next to its calls: `bool call_succeeded(Status)` and
/// `std::string call_error(Status)`.
#define WEAVE_CHECK_CALL(call, op)                                                       \
  do {                                                                                   \
    const auto weave_status_ = (call);                                                   \
    if (__builtin_expect(!::weave::detail::call_succeeded(weave_status_), 0))            \
      ::weave::detail::fail_call(op, #call, ::weave::detail::call_error(weave_status_)); \
  } while (0)

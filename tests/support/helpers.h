#pragma once
#include <doctest/doctest.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include <unistd.h>

#include "weave/weave.h"

namespace weave::test {

/// Checks that `expr` throws weave::Error whose message starts with "[op]" and contains `part`.
#define CHECK_WEAVE_ERROR(expr, op, part)                                             \
  do {                                                                                \
    bool threw_ = false;                                                              \
    try {                                                                             \
      (void)(expr);                                                                   \
    } catch (const ::weave::Error& e_) {                                              \
      threw_ = true;                                                                  \
      std::string message_ = e_.what();                                               \
      CHECK_MESSAGE(message_.rfind(std::string("[") + (op) + "]", 0) == 0, message_); \
      CHECK_MESSAGE(message_.find(part) != std::string::npos, message_);              \
    }                                                                                 \
    CHECK_MESSAGE(threw_, "expected weave::Error from " #expr);                       \
  } while (0)

/// The message of the weave::Error that `call` raises ("" if it returns).
template <class F>
std::string error_of(F&& call) {
  try {
    call();
  } catch (const ::weave::Error& e) {
    return e.what();
  }
  return "";
}

/// What `call` writes to stderr (the process's file descriptor 2, so C and C++ writes alike).
template <class F>
std::string stderr_of(F&& call) {
  std::fflush(stderr);
  std::FILE* capture = std::tmpfile();
  REQUIRE(capture != nullptr);
  const int saved = ::dup(2);
  ::dup2(::fileno(capture), 2);
  try {
    call();
  } catch (...) {
    std::fflush(stderr);
    ::dup2(saved, 2);
    ::close(saved);
    std::fclose(capture);
    throw;
  }
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  std::string text;
  std::rewind(capture);
  for (int c; (c = std::fgetc(capture)) != EOF;) text += char(c);
  std::fclose(capture);
  return text;
}

/// Checks every parameter of `model` against `expected` (float64 training: to 1e-11 relative).
inline void check_params(nn::Module& model, const std::vector<Tensor>& expected) {
  auto params = model.parameters();
  REQUIRE(params.size() == expected.size());
  for (size_t i = 0; i < params.size(); ++i) {
    CAPTURE(i);
    CHECK(allclose(params[i], expected[i], 1e-11, 1e-13));
  }
}

/// A directory every rank of the world agrees on (named from rank 0's pid and `what`), empty.
/// Collective.
inline std::string shared_dir(const std::string& what) {
  Tensor id = full({1}, double(getpid()), {.dtype = kInt64});
  dist::broadcast(id, 0);
  const std::string dir = (std::filesystem::temp_directory_path() /
                           fmt::format("weave_sharded_{}_{}", id.item<int64_t>(), what))
                              .string();
  if (dist::rank() == 0) std::filesystem::remove_all(dir);
  dist::barrier();
  return dir;
}

inline bool close(const Tensor& a, const Tensor& b, double rtol = 1e-5, double atol = 1e-6) {
  return a.shape() == b.shape() && allclose(a, b, rtol, atol);
}

/// The largest |a - b| relative to b's largest magnitude (the truth's; an exactly zero truth,
/// such as the gradient of attention over one key, is compared to 1e-3).
inline double relative_error(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  const double scale = max(abs(b.to(kFloat64))).item<double>();
  return max(abs(a.to(kFloat64) - b.to(kFloat64))).item<double>() / std::max(scale, 1e-3);
}

}  // namespace weave::test

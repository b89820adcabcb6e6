// Heap allocations of ops that record nothing (NoGradGuard, or no input requiring grad): an
// op may allocate its output and nothing else. This binary replaces the global operator new
// with a counting one, so it is its own executable.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <functional>
#include <optional>

#include "weave/weave.h"

// Defined with the replaced operator new in counting_new.cpp (its own translation unit, so the
// compiler never sees new and free paired inline).
long allocations_on_this_thread();

using namespace weave;

namespace {

// Allocations made by fn, after one warm-up call (the host allocator's cache and any
// first-use statics are filled by then).
long count_allocations(const std::function<void()>& fn) {
  fn();
  const long before = allocations_on_this_thread();
  fn();
  return allocations_on_this_thread() - before;
}

}  // namespace

TEST_SUITE("allocations") {
  TEST_CASE("ops that record nothing allocate only their output") {
    manual_seed(0);
    Tensor a = randn({64, 32}), b = randn({64, 32}), w = randn({32, 16});
    Tensor sink;
    const long one_output = count_allocations([&] { sink = empty({64, 32}); });
    const long one_view = count_allocations([&] { sink = a.t(); });
    INFO("an output costs " << one_output << ", a view " << one_view);
    CHECK(one_output >= 1);

    struct Case {
      const char* name;
      std::function<Tensor()> op;
      long expected;
    };
    const std::vector<Case> cases = {
        {"mul", [&] { return a * b; }, one_output},
        {"add", [&] { return a + b; }, one_output},
        {"exp", [&] { return exp(a); }, one_output},
        {"tanh", [&] { return tanh(a); }, one_output},
        {"relu", [&] { return relu(a); }, one_output},
        {"reshape",
         [&] {
           return a.reshape({32, 64});
         },
         one_view},
        {"transpose", [&] { return a.t(); }, one_view},
    };
    for (bool no_grad_guard : {true, false}) {
      // Either no grad mode, or grad mode with no input requiring grad: nothing is recorded.
      std::optional<NoGradGuard> guard;
      if (no_grad_guard) guard.emplace();
      for (const Case& c : cases) {
        CAPTURE(c.name);
        CAPTURE(no_grad_guard);
        CHECK(count_allocations([&] { sink = c.op(); }) == c.expected);
      }
    }
  }

  TEST_CASE("recording does allocate (the counter sees the graph)") {
    Tensor a = randn({8, 8}).requires_grad_(), b = randn({8, 8});
    Tensor sink;
    const long one_output = count_allocations([&] { sink = empty({8, 8}); });
    CHECK(count_allocations([&] { sink = a * b; }) > one_output);
  }
}

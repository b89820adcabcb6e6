// A global operator new that counts this thread's allocations (for test_alloc.cpp).
#include <cstdlib>
#include <new>

namespace {
thread_local long allocations = 0;
}

long allocations_on_this_thread() {
  return allocations;
}

void* operator new(std::size_t n) {
  ++allocations;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}

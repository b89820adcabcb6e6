// An LD_PRELOAD shim for weave-run's tests: fsync (and fdatasync) sleep SLOW_FSYNC_MS
// milliseconds before doing their work, which makes a small checkpoint's save as slow as a large
// one on a busy file system, without a test hook in the library.
#include <dlfcn.h>

#include <chrono>
#include <cstdlib>
#include <thread>

namespace {
void pause_as_configured() {
  const char* ms = std::getenv("SLOW_FSYNC_MS");
  if (ms != nullptr) std::this_thread::sleep_for(std::chrono::milliseconds(std::atoll(ms)));
}
template <class F>
F real(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_NEXT, name));
}
}  // namespace

extern "C" int fsync(int fd) {
  pause_as_configured();
  static auto next = real<int (*)(int)>("fsync");
  return next(fd);
}

extern "C" int fdatasync(int fd) {
  pause_as_configured();
  static auto next = real<int (*)(int)>("fdatasync");
  return next(fd);
}

// The agreement board: a POSIX shared-memory segment of cache lines, one pair per rank.
#include "weave/distributed/agreement_board.h"

#include "weave/distributed/agreement.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace weave::dist::detail {

namespace {

// A slot is [round, value 0, ..., value 14] on a line of its own: 128 bytes, because x86
// prefetches lines in adjacent pairs, and two ranks' slots on one pair would bounce.
constexpr size_t kLine = 128;
constexpr size_t kWords = kLine / sizeof(uint64_t);
static_assert(AgreementBoard::kRoundWords + 1 == kWords, "a round fills its slot's line");
static_assert(std::atomic_ref<uint64_t>::is_always_lock_free,
              "the board's words are shared between processes: they must be lock-free");

// Line 0 holds the creator's nonce and the rank count; then two slots per rank.
size_t segment_bytes(int ranks) {
  return kLine * (1 + 2 * size_t(ranks));
}

uint64_t load(uint64_t& word) {
  return std::atomic_ref<uint64_t>(word).load(std::memory_order_acquire);
}
void store(uint64_t& word, uint64_t value, std::memory_order order) {
  std::atomic_ref<uint64_t>(word).store(value, order);
}

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Ranks with a core each spin, as MPI's own waits do: yielding to a compute thread on the same
// core (DDP's backward, beside the queue's worker) delays the round by a scheduler slice, 7 ms
// of a 45 ms step. Ranks that share cores yield after about a microsecond instead, as Open MPI
// does when oversubscribed: spinning there made a round 50x slower at 4 ranks on 2 cores.
// After 5 ms both sleep 50 µs at a time: a rank that waits that long waits for a peer's
// computation, not for a message, and need not burn a core meanwhile.
void wait_for_round(uint64_t& posted, uint64_t round, bool cores_shared) {
  constexpr int kSpins = 64;
  for (int spin = 0; spin < kSpins; ++spin) {
    if (load(posted) == round) return;
    cpu_relax();
  }
  const auto start = std::chrono::steady_clock::now();
  bool slow = false;
  for (uint32_t i = 0; load(posted) != round; ++i) {
    if (!slow && i % 256 == 255)
      slow = std::chrono::steady_clock::now() - start > std::chrono::milliseconds(5);
    if (slow)
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    else if (cores_shared)
      std::this_thread::yield();
    else
      cpu_relax();
  }
}

// The machine and network namespace this process runs in. Ranks in other namespaces on one
// machine (containers, the test suite's pretend hosts) could often map one board, but stand
// for machines of their own: they keep the all_reduce, as ranks on other machines do.
std::string machine_identity() {
  char host[64] = {}, net[64] = {};
  gethostname(host, sizeof(host) - 1);
  const ssize_t length = readlink("/proc/self/ns/net", net, sizeof(net) - 1);
  return fmt::format("{} {}", host, length > 0 ? net : "");
}

void* map_segment(int fd, int ranks) {
  void* memory =
      mmap(nullptr, segment_bytes(ranks), PROT_READ | PROT_WRITE, MAP_SHARED, fd, /*offset=*/0);
  close(fd);
  return memory == MAP_FAILED ? nullptr : memory;
}

}  // namespace

AgreementBoard::AgreementBoard(std::string name, void* memory, int ranks, int me)
    : name_(std::move(name)), memory_(memory), ranks_(ranks), me_(me) {}

AgreementBoard::~AgreementBoard() {
  unlink();
  munmap(memory_, segment_bytes(ranks_));
}

uint64_t* AgreementBoard::slot(uint64_t round, int rank) const {
  const size_t line = 1 + size_t(round & 1) * size_t(ranks_) + size_t(rank);
  return static_cast<uint64_t*>(memory_) + line * kWords;
}

void AgreementBoard::sweep_dead_segments() {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string file = entry.path().filename().string();
    long long pid = 0;
    // A killed job leaves its board's name behind: its creator's pid tells whether it is dead.
    if (std::sscanf(file.c_str(), "weave-agree-%lld-", &pid) != 1 || pid <= 0) continue;
    if (::kill(pid_t(pid), 0) == 0 || errno != ESRCH) continue;
    shm_unlink(("/" + file).c_str());
  }
}

std::unique_ptr<AgreementBoard> AgreementBoard::create(int ranks) {
  static std::atomic<int> boards_made{0};
  sweep_dead_segments();
  // Unpredictable: a name another local user could guess and take first would deny the board
  // to the job; the pid stays in it for the sweep.
  std::random_device entropy;
  std::string name;
  int fd = -1;
  for (int attempt = 0; attempt < 4 && fd < 0; ++attempt) {
    const uint64_t random = (uint64_t(entropy()) << 32) ^ entropy();
    name = fmt::format("/weave-agree-{}-{}-{:016x}", getpid(), boards_made++, random);
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  }
  if (fd < 0) return nullptr;
  void* memory = nullptr;
  if (ftruncate(fd, off_t(segment_bytes(ranks))) == 0)
    memory = map_segment(fd, ranks);  // closes fd
  else
    close(fd);
  if (memory == nullptr) {
    shm_unlink(name.c_str());
    return nullptr;
  }
  std::unique_ptr<AgreementBoard> board(new AgreementBoard(name, memory, ranks, 0));
  board->named_ = true;
  // A nonce the openers must find: a stale segment of the same name, or one in another
  // machine's /dev/shm, is not this board.
  const auto now = uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
  board->nonce_ = (now * 0x9E3779B97F4A7C15ull) ^ uint64_t(getpid()) ^ 1;
  auto* header = static_cast<uint64_t*>(memory);
  store(header[1], uint64_t(ranks), std::memory_order_relaxed);
  store(header[0], board->nonce_, std::memory_order_release);
  return board;
}

std::unique_ptr<AgreementBoard> AgreementBoard::open(const std::string& name, uint64_t nonce,
                                                     int ranks, int me) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) return nullptr;
  struct stat info {};
  if (fstat(fd, &info) != 0 || size_t(info.st_size) != segment_bytes(ranks)) {
    close(fd);
    return nullptr;
  }
  void* memory = map_segment(fd, ranks);
  if (memory == nullptr) return nullptr;
  std::unique_ptr<AgreementBoard> board(new AgreementBoard(name, memory, ranks, me));
  auto* header = static_cast<uint64_t*>(memory);
  if (load(header[0]) != nonce || load(header[1]) != uint64_t(ranks)) return nullptr;
  board->nonce_ = nonce;
  return board;
}

std::unique_ptr<AgreementBoard> AgreementBoard::connect(Communicator& host, bool cores_shared) {
  const int ranks = host.size(), me = host.rank();
  if (ranks < 2 || ranks > kMaxRanks) return nullptr;  // the same verdict on every rank
  struct Offer {
    char name[56];
    uint64_t nonce;
    char machine[128];
  } offer{};
  const std::string machine = machine_identity();
  std::unique_ptr<AgreementBoard> board;
  if (me == 0 && (board = create(ranks))) {
    std::strncpy(offer.name, board->name().c_str(), sizeof(offer.name) - 1);
    std::strncpy(offer.machine, machine.c_str(), sizeof(offer.machine) - 1);
    offer.nonce = board->nonce();
  }
  host.broadcast(&offer, int64_t(sizeof(offer)), kUInt8, 0);
  if (me != 0 && offer.name[0] != '\0' &&
      machine.compare(0, sizeof(offer.machine) - 1, offer.machine) == 0)
    board = open(offer.name, offer.nonce, ranks, me);
  int64_t missing = board ? 0 : 1;
  max_words(host, nullptr, std::span(&missing, 1));  // no board yet: over the host
  if (board) board->unlink();                        // every rank has opened it, or given up
  // Ranks on other machines never share a board; ranks on one that could not make one say so
  // once (the guard then agrees through an all_reduce, a few tenths of a microsecond slower).
  static std::atomic<bool> warned{false};
  if (missing && me == 0 && offer.name[0] == '\0' && !warned.exchange(true))
    std::fprintf(stderr,
                 "[weave] warning: no shared-memory agreement board could be made in /dev/shm; "
                 "the collective guard agrees through an all_reduce instead\n");
  if (missing) return nullptr;
  board->cores_shared_ = cores_shared;
  return board;
}

void AgreementBoard::unlink() {
  if (!named_) return;
  shm_unlink(name_.c_str());
  named_ = false;
}

void AgreementBoard::max(std::span<int64_t, kRoundWords> values) {
  const uint64_t round = ++round_;
  uint64_t* mine = slot(round, me_);
  for (size_t i = 0; i < kRoundWords; ++i)
    store(mine[1 + i], uint64_t(values[i]), std::memory_order_relaxed);
  store(mine[0], round, std::memory_order_release);
  for (int rank = 0; rank < ranks_; ++rank) {
    if (rank == me_) continue;
    uint64_t* theirs = slot(round, rank);
    wait_for_round(theirs[0], round, cores_shared_);
    for (size_t i = 0; i < kRoundWords; ++i)
      values[i] = std::max(
          values[i],
          int64_t(std::atomic_ref<uint64_t>(theirs[1 + i]).load(std::memory_order_relaxed)));
  }
}

}  // namespace weave::dist::detail

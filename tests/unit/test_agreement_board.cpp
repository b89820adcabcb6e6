// The guard's shared-memory board, with threads of one process playing the ranks: every
// round gives every rank the element-wise maximum over all ranks' values of that round (what
// all_reduce(Max) gives), whatever order and delays the ranks arrive with; and a board opens
// only with its creator's name, size and nonce.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "weave/distributed/agreement_board.h"
#include "weave/tensor/error.h"

using weave::dist::detail::AgreementBoard;

namespace {

// Rank `rank`'s value k in round `round`: spread over the whole int64 range, negative too.
int64_t value_of(int rank, uint64_t round, int k) {
  uint64_t h = (round * 0x9e3779b97f4a7c15ull) ^ (uint64_t(rank) << 20) ^ uint64_t(k);
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 29;
  return int64_t(h);
}

}  // namespace

TEST_SUITE("agreement_board") {
  TEST_CASE("every round gives every rank the maximum of that round's values") {
    // two ranks spinning, as ranks with a core each do; three and five, more than this
    // machine's cores, yielding
    for (int ranks : {2, 3, 5}) {
      CAPTURE(ranks);
      const bool cores_shared = ranks > 2;
      std::vector<std::unique_ptr<AgreementBoard>> boards(static_cast<size_t>(ranks));
      boards[0] = AgreementBoard::create(ranks);
      REQUIRE(boards[0] != nullptr);
      for (int r = 1; r < ranks; ++r) {
        boards[size_t(r)] = AgreementBoard::open(boards[0]->name(), boards[0]->nonce(), ranks, r);
        REQUIRE(boards[size_t(r)] != nullptr);
      }
      for (auto& board : boards) board->set_cores_shared(cores_shared);
      boards[0]->unlink();
      const uint64_t rounds = cores_shared ? 3000 : 1000;
      std::vector<int64_t> wrong(size_t(ranks), 0);
      std::vector<std::thread> threads;
      for (int r = 0; r < ranks; ++r)
        threads.emplace_back([&, r] {
          std::mt19937 random(unsigned(r + 1));
          for (uint64_t round = 1; round <= rounds; ++round) {
            // now and then a rank is late, so the others wait, spin out and yield, and a rank
            // that is not late runs a round ahead on the other parity's slot
            if (random() % 97 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
            // every word of the line: a slot carries a whole round
            constexpr size_t kWords = AgreementBoard::kRoundWords;
            int64_t values[kWords], expected[kWords];
            for (int k = 0; k < int(kWords); ++k) {
              values[k] = value_of(r, round, k);
              expected[k] = value_of(0, round, k);
              for (int other = 1; other < ranks; ++other)
                expected[k] = std::max(expected[k], value_of(other, round, k));
            }
            boards[size_t(r)]->max(values);
            for (size_t k = 0; k < kWords; ++k) wrong[size_t(r)] += values[k] != expected[k];
          }
        });
      for (auto& t : threads) t.join();
      for (int r = 0; r < ranks; ++r) CHECK(wrong[size_t(r)] == 0);
    }
  }

  TEST_CASE("a board opens only by its own name, size and nonce") {
    auto board = AgreementBoard::create(2);
    REQUIRE(board != nullptr);
    CHECK(AgreementBoard::open(board->name(), board->nonce() + 1, 2, 1) == nullptr);
    CHECK(AgreementBoard::open(board->name(), board->nonce(), 3, 1) == nullptr);
    CHECK(AgreementBoard::open(board->name() + "-other", board->nonce(), 2, 1) == nullptr);
    CHECK(AgreementBoard::open(board->name(), board->nonce(), 2, 1) != nullptr);
    board->unlink();  // the name is gone; mapped boards live on
    CHECK(AgreementBoard::open(board->name(), board->nonce(), 2, 1) == nullptr);
  }

  TEST_CASE("board names cannot be taken ahead, and dead jobs' boards are swept") {
    // Another user takes the names this process's next boards had under the old scheme.
    std::vector<std::string> squatted;
    for (int n = 0; n < 64; ++n) {
      squatted.push_back(fmt::format("/weave-agree-{}-{}", ::getpid(), n));
      const int fd = shm_open(squatted.back().c_str(), O_CREAT | O_RDWR, 0600);
      if (fd >= 0) ::close(fd);
    }
    auto first = AgreementBoard::create(2), second = AgreementBoard::create(2);
    REQUIRE(first != nullptr);
    REQUIRE(second != nullptr);
    CHECK(first->name().size() > squatted[0].size() + 16);  // 64 random bits in the name
    CHECK(first->name() != second->name());
    for (const std::string& name : squatted) shm_unlink(name.c_str());
    // A board left by a job that was killed: its creator's pid is gone.
    const pid_t child = ::fork();
    if (child == 0) std::_Exit(0);
    REQUIRE(child > 0);
    REQUIRE(::waitpid(child, nullptr, 0) == child);
    const std::string stale = fmt::format("weave-agree-{}-0-00000000deadbeef", child);
    const std::string live = fmt::format("weave-agree-{}-9-00000000deadbeef", ::getpid());
    for (const std::string& name : {stale, live}) {
      const int fd = shm_open(("/" + name).c_str(), O_CREAT | O_RDWR, 0600);
      REQUIRE(fd >= 0);
      ::close(fd);
    }
    AgreementBoard::sweep_dead_segments();
    CHECK_FALSE(std::filesystem::exists("/dev/shm/" + stale));
    CHECK(std::filesystem::exists("/dev/shm/" + live));  // this process is alive
    shm_unlink(("/" + live).c_str());
  }
}

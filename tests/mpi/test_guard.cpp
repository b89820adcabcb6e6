// Mismatched calls across ranks, and arguments only one rank can judge: under the default
// guard (its rounds on the shared-memory board, and as all_reduces) and under full check mode,
// every rank involved raises (none hangs, none gets a silent wrong result), the message names
// the difference, and the group stays usable. set_check_mode switches every rank together, or
// none.
#include <doctest/doctest.h>

#include <chrono>
#include <thread>

#include "helpers.h"
#include "weave/distributed/distributed.h"
#include "weave/distributed/functional.h"
#include "weave/distributed/runtime.h"

using namespace weave;
using dist::CheckMode;
using dist::ReduceOp;
using weave::test::error_of;

namespace {

// How the ranks check: the guard's rounds on the board their shared memory holds (the default
// on one machine), or as all_reduces (ranks on several machines), or in full.
struct Variant {
  CheckMode mode;
  bool board;
  const char* name;
};
const Variant kVariants[] = {{CheckMode::Guard, true, "guard on the board"},
                             {CheckMode::Guard, false, "guard by all_reduce"},
                             {CheckMode::Full, true, "full"}};

std::unique_ptr<dist::detail::AgreementBoard>& world_board() {
  return dist::world().impl()->board;
}

// Switches every rank to a variant for one test (all ranks run the tests in step).
class ScopedVariant {
 public:
  explicit ScopedVariant(const Variant& v) : saved_(dist::check_mode()) {
    dist::set_check_mode(v.mode);
    if (!v.board) parked_ = std::move(world_board());
  }
  ~ScopedVariant() {
    if (parked_) world_board() = std::move(parked_);
    dist::set_check_mode(saved_);
  }
  ScopedVariant(const ScopedVariant&) = delete;
  ScopedVariant& operator=(const ScopedVariant&) = delete;

 private:
  CheckMode saved_;
  std::unique_ptr<dist::detail::AgreementBoard> parked_;
};

// After an error the group must still work: an all_reduce of ones gives the world size.
void check_group_still_works() {
  Tensor ok = ones({3});
  dist::all_reduce(ok);
  CHECK(ok.to_vector<float>() == std::vector<float>(3, float(dist::world_size())));
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_SUITE("guard") {
  TEST_CASE("mismatched collectives raise on every rank, naming the field that differs") {
    if (dist::world_size() < 2) return;
    const bool odd = dist::rank() % 2 == 1;
    struct Case {
      const char* what;
      std::function<void()> call;
      const char* field;
    };
    const std::vector<Case> cases = {
        {"lengths [4] vs [1000]", [&] { dist::all_reduce(zeros({odd ? 1000 : 4})); }, "shape"},
        {"same count, other shape",
         [&] {
           dist::all_reduce(odd ? zeros({3, 2}) : zeros({2, 3}));
         },
         "shape"},
        {"float32 vs int32",
         [&] { dist::all_reduce(zeros({4}, {.dtype = odd ? kInt32 : kFloat32})); }, "dtype"},
        {"sum vs max", [&] { dist::all_reduce(zeros({4}), odd ? ReduceOp::Max : ReduceOp::Sum); },
         "reduce op"},
        {"roots 0 vs 1", [&] { dist::broadcast(zeros({4}), odd ? 1 : 0); }, "root"},
        {"all_reduce vs broadcast",
         [&] {
           if (odd)
             dist::broadcast(zeros({4}), 0);
           else
             dist::all_reduce(zeros({4}));
         },
         "op"},
    };
    for (const Variant& variant : kVariants) {
      ScopedVariant scoped(variant);
      for (const Case& c : cases) {
        CAPTURE(variant.name);
        CAPTURE(c.what);
        const std::string message = error_of(c.call);
        CHECK_MESSAGE(contains(message, "collective mismatch"), message);
        CHECK_MESSAGE(contains(message, std::string("differ in ") + c.field), message);
        check_group_still_works();
      }
    }
  }

  TEST_CASE("agree_max: the maximum of any number of words, in every mode and on both transports") {
    const int n = dist::world_size(), r = dist::rank();
    // word i of rank q: spread over signs and magnitudes, so that a word taken from the wrong
    // round, rank or position shows
    auto word = [](int q, size_t i) {
      const int64_t v = int64_t((uint64_t(i) * 0x9e3779b97f4a7c15ull) >> 8) ^ (int64_t(q) << 40);
      return (i + size_t(q)) % 3 == 0 ? -v : v;
    };
    const Variant off{CheckMode::Off, true, "off"};
    std::vector<Variant> variants(std::begin(kVariants), std::end(kVariants));
    variants.push_back(off);
    for (const Variant& variant : variants) {
      ScopedVariant scoped(variant);
      // 1 word, the words that ride in the guard's round, one more, and three board rounds
      for (size_t count : {size_t{1}, size_t{12}, size_t{13}, size_t{40}}) {
        CAPTURE(variant.name);
        CAPTURE(count);
        std::vector<int64_t> words, expected;
        for (size_t i = 0; i < count; ++i) {
          words.push_back(word(r, i));
          int64_t most = word(0, i);
          for (int q = 1; q < n; ++q) most = std::max(most, word(q, i));
          expected.push_back(most);
        }
        CHECK(dist::agree_max(words) == expected);
      }
      // the ranks ask with different numbers of words: every rank raises, none reads a torn
      // round, and the group stays usable
      if (n >= 2 && variant.mode != CheckMode::Off) {
        CAPTURE(variant.name);
        const std::string message =
            error_of([&] { dist::agree_max(std::vector<int64_t>(r == n - 1 ? 20 : 2, 1)); });
        CHECK_MESSAGE(contains(message, "agree_max"), message);
        CHECK_MESSAGE(contains(message, "differ in shape"), message);
        check_group_still_works();
      }
    }
  }

  TEST_CASE("a rank whose own arguments fail makes the others raise instead of waiting") {
    const int n = dist::world_size();
    if (n < 2) return;
    const int r = dist::rank();
    for (const Variant& variant : kVariants) {
      ScopedVariant scoped(variant);
      CAPTURE(variant.name);
      // scatter: only the root holds the input; here it has the wrong number of rows
      std::string message = error_of([&] {
        Tensor out = zeros({2});
        dist::scatter(out, r == 0 ? zeros({2 * n + 1}) : Tensor(), 0);
      });
      if (r == 0)
        CHECK_MESSAGE(contains(message, "input has shape"), message);
      else
        CHECK_MESSAGE((contains(message, "rank 0 of group") && contains(message, "rejected")),
                      message);
      check_group_still_works();
      // gather: only the root holds the output
      message = error_of([&] { dist::gather(r == 0 ? zeros({3}) : Tensor(), ones({2}), 0); });
      if (r == 0)
        CHECK_MESSAGE(contains(message, "output has shape"), message);
      else
        CHECK_MESSAGE(contains(message, "rejected"), message);
      check_group_still_works();
      // a check any rank may fail alone: an undefined input on the last rank
      message = error_of([&] { dist::all_reduce(r == n - 1 ? Tensor() : zeros({2})); });
      CHECK_MESSAGE(!message.empty(), "every rank must raise");
      check_group_still_works();
    }
  }

  TEST_CASE("the functional scatter: a root that rejects its input stops the others too") {
    const int n = dist::world_size();
    if (n < 2) return;
    const std::string message = error_of([&] {
      (void)dist::functional::scatter(dist::rank() == 0 ? zeros({n + 1, 2}) : Tensor(), 0, 0);
    });
    if (dist::rank() == 0)
      CHECK_MESSAGE(contains(message, "does not divide"), message);
    else
      CHECK_MESSAGE(contains(message, "the root (group rank 0) rejected its input"), message);
    check_group_still_works();
  }

  TEST_CASE("a receive that does not match the send raises, and the channel stays in step") {
    if (dist::world_size() < 2) return;
    const int r = dist::rank();
    for (const Variant& variant : kVariants) {
      ScopedVariant scoped(variant);
      CAPTURE(variant.name);
      struct Case {
        Tensor sent, received;
        const char* part;
      };
      const std::vector<Case> cases = {
          {ones({4}), zeros({6}), "sent float32 [4], but this rank receives float32 [6]"},
          {ones({4}), zeros({2}, {.dtype = kFloat64}), "receives float64 [2]"},
          {ones({2, 3}), zeros({3, 2}), "receives float32 [3, 2]"},
      };
      for (const Case& c : cases) {
        if (r == 0) dist::send(c.sent, 1);
        if (r == 1) {
          const std::string message = error_of([&] { dist::recv(c.received, 0); });
          CHECK_MESSAGE(contains(message, c.part), message);
        }
        // the next matching pair goes through untouched: the bad payload was taken off the wire
        if (r == 0) dist::send(full({3}, 7.0), 1);
        if (r == 1) {
          Tensor t = zeros({3});
          dist::recv(t, 0);
          CHECK(t.to_vector<float>() == std::vector<float>(3, 7.0f));
        }
      }
      // isend carries the header too
      if (r == 0) {
        dist::isend(ones({5}), 1);
        dist::wait_sends();
      }
      if (r == 1) {
        const std::string message = error_of([&] { dist::recv(zeros({5}, {.dtype = kInt32}), 0); });
        CHECK_MESSAGE(contains(message, "receives int32 [5]"), message);
      }
      dist::barrier();
    }
  }

  TEST_CASE("a non-member gets the membership error even from a group of one") {
    if (dist::world_size() < 2) return;
    const dist::Group only_zero = dist::new_group({0});
    if (dist::rank() == 0) {
      Tensor x = ones({2});
      CHECK(dist::functional::all_reduce_sum(x, only_zero).is_same(x));
      return;
    }
    CHECK_WEAVE_ERROR(dist::functional::all_reduce_sum(ones({2}), only_zero), "all_reduce_sum",
                      "not in group");
    CHECK_WEAVE_ERROR(dist::functional::broadcast(ones({2}), 0, only_zero), "broadcast",
                      "not in group");
    CHECK_WEAVE_ERROR(dist::functional::copy_to_group(ones({2}), only_zero), "copy_to_group",
                      "not in group");
  }

  TEST_CASE("two threads issuing on one group at once is an error, not a race") {
    if (dist::world_size() < 2) return;
    const dist::Group world = dist::world();
    if (dist::rank() == 0) {
      // the main thread sits in a blocking all_reduce until rank 1 joins, 300 ms later
      std::string second;
      std::thread other([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        second = error_of([&] { dist::all_reduce(zeros({2}), ReduceOp::Sum, world); });
      });
      Tensor t = ones({2});
      dist::all_reduce(t, ReduceOp::Sum, world);
      other.join();
      CHECK_MESSAGE(contains(second, "two threads issued collectives"), second);
      CHECK(t.to_vector<float>() == std::vector<float>(2, float(dist::world_size())));
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      Tensor t = ones({2});
      dist::all_reduce(t, ReduceOp::Sum, world);
    }
    check_group_still_works();
  }

  TEST_CASE("ranks on one machine meet on a board; a group of one needs none") {
    const int n = dist::world_size();
    // every rank of these tests runs on this machine, with /dev/shm: no board is a regression
    // to the all_reduce, which costs 3-10x more per collective
    CHECK((world_board() != nullptr) == (n >= 2));
    if (n >= 2) {
      const dist::Group pair = dist::new_group({n - 1, 0});
      if (dist::rank() == 0 || dist::rank() == n - 1) CHECK(pair.impl()->board != nullptr);
    }
    const dist::Group alone = dist::new_group({0});
    if (dist::rank() == 0) CHECK(alone.impl()->board == nullptr);
  }

  TEST_CASE("set_check_mode switches every rank, or raises on every rank and switches none") {
    const int n = dist::world_size(), r = dist::rank();
    const CheckMode before = dist::check_mode();
    for (CheckMode mode : {CheckMode::Off, CheckMode::Full, CheckMode::Guard, before}) {
      dist::set_check_mode(mode);
      CHECK(dist::check_mode() == mode);
      check_group_still_works();
      if (n < 2) continue;
      if (r == 0) dist::send(full({2}, 5.0), 1);  // with a header, or without, on both sides
      if (r == 1) {
        Tensor t = zeros({2});
        dist::recv(t, 0);
        CHECK(t.to_vector<float>() == std::vector<float>(2, 5.0f));
      }
    }
    if (n < 2) return;
    std::string message =
        error_of([&] { dist::set_check_mode(r == 0 ? CheckMode::Full : CheckMode::Off); });
    CHECK_MESSAGE(contains(message, "the ranks use different check modes"), message);
    CHECK(dist::check_mode() == before);
    check_group_still_works();
    // a message sent before the switch and received after it would cross modes: refused
    if (r == 0) {
      dist::isend(full({3}, 2.0), 1);
      dist::wait_sends();
    }
    message = error_of([&] { dist::set_check_mode(CheckMode::Off); });
    if (r == 1)
      CHECK_MESSAGE(contains(message, "ranks [0] sent this rank point-to-point messages"), message);
    else
      CHECK_MESSAGE(contains(message, "a point-to-point message to rank 1 is in flight"), message);
    CHECK(dist::check_mode() == before);
    if (r == 1) {  // received under the mode it was sent with
      Tensor t = zeros({3});
      dist::recv(t, 0);
      CHECK(t.to_vector<float>() == std::vector<float>(3, 2.0f));
    }
    dist::set_check_mode(CheckMode::Off);  // nothing in flight now
    CHECK(dist::check_mode() == CheckMode::Off);
    dist::set_check_mode(before);
    check_group_still_works();
  }

  TEST_CASE("set_check_mode refuses a mode that is none, and a switch while another thread calls") {
    const CheckMode before = dist::check_mode();
    std::string message = error_of([] { dist::set_check_mode(static_cast<CheckMode>(7)); });
    CHECK_MESSAGE(contains(message, "CheckMode(7) is not a check mode"), message);
    CHECK(dist::check_mode() == before);
    check_group_still_works();
    if (dist::world_size() < 2) return;
    // Rank 0's second thread waits in a barrier on a group of its own that rank 1 joins only
    // after the switch was tried: every rank must raise at once, not wait for the timeout.
    dist::Group side = dist::duplicate(dist::world());
    std::thread other;
    if (dist::rank() == 0) other = std::thread([&] { dist::barrier(side); });
    if (dist::rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const auto start = std::chrono::steady_clock::now();
    message = error_of([] { dist::set_check_mode(CheckMode::Full); });
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (dist::rank() == 0)
      CHECK_MESSAGE(contains(message, "another thread of this rank is inside a call on group"),
                    message);
    else
      CHECK_MESSAGE(contains(message, "rejected its arguments to set_check_mode"), message);
    CHECK(waited < 2.0);
    CHECK(dist::check_mode() == before);
    if (dist::rank() != 0) dist::barrier(side);
    if (other.joinable()) other.join();
    check_group_still_works();
  }

  TEST_CASE("realign: a mismatch with calls queued behind it, then the group pairs again") {
    const int n = dist::world_size(), r = dist::rank();
    if (n < 2) return;
    const uint64_t disagreements = dist::disagreements();
    // Rank 0 issues four asynchronous all_reduces, the others one of another shape: the first
    // pair mismatches, and rank 0's other three can never pair.
    std::vector<dist::Work> works;
    const int64_t length = r == 0 ? 4 : 3;
    for (int i = 0; i < (r == 0 ? 4 : 1); ++i)
      works.push_back(dist::all_reduce(ones({length}), ReduceOp::Sum, dist::world(), true));
    std::string message = error_of([&] { works.front().wait(); });
    CHECK_MESSAGE(contains(message, "collective mismatch"), message);
    CHECK(dist::disagreements() > disagreements);
    dist::realign();
    for (size_t i = 1; i < works.size(); ++i)
      CHECK_FALSE(error_of([&] { works[i].wait(); }).empty());
    Tensor t = full({5}, double(r + 1));
    dist::all_reduce(t);
    CHECK(t.to_vector<float>() == std::vector<float>(5, float(n * (n + 1) / 2)));
    check_group_still_works();
  }
}

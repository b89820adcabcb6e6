// The check mode: read from the environment at init, switched together by set_check_mode; and
// realign, which brings a group's ranks back in step after the check raised.
#include <cstdlib>
#include <string>

#include "weave/distributed/agreement.h"
#include "weave/distributed/runtime.h"

namespace weave::dist {

namespace detail {

CheckMode check_mode_from_env() {
  const char* v = std::getenv("WEAVE_CHECK_COLLECTIVES");
  if (v == nullptr || *v == '\0') return CheckMode::Guard;
  const std::string s = v;
  if (s == "0" || s == "off") return CheckMode::Off;
  if (s == "guard") return CheckMode::Guard;
  if (s == "1" || s == "full") return CheckMode::Full;
  WEAVE_FAIL("init",
             "WEAVE_CHECK_COLLECTIVES='{}' is not a check mode; hint: use 0/off, guard "
             "(the default) or 1/full",
             s);
}

}  // namespace detail

namespace {

using namespace detail;

const char* mode_name(CheckMode mode) {
  return mode == CheckMode::Off ? "off" : mode == CheckMode::Guard ? "guard" : "full";
}

// The groups on which another thread of this rank is inside a call now.
std::vector<std::string> groups_busy_elsewhere() {
  Runtime& r = runtime();
  std::vector<std::string> busy;
  std::lock_guard lock(r.groups_mutex);
  for (auto& weak : r.groups) {
    auto g = weak.lock();
    if (!g) continue;
    const std::thread::id issuer = g->issuer.load();
    if (issuer != std::thread::id() && issuer != std::this_thread::get_id())
      busy.push_back(fmt::format("[{}]", fmt::join(g->ranks, ", ")));
  }
  return busy;
}

// The world ranks that sent this rank more messages than it has issued receives for: their
// messages would be received under the new mode (an all_to_all of the counts).
std::vector<int> senders_ahead(Communicator& world) {
  const Runtime& r = runtime();
  std::vector<int64_t> sent(size_t(r.size)), told(size_t(r.size));
  for (int p = 0; p < r.size; ++p) sent[size_t(p)] = r.sent_to[size_t(p)].load();
  world.all_to_all(sent.data(), told.data(), 1, kInt64);
  std::vector<int> ahead;
  for (int p = 0; p < r.size; ++p)
    if (told[size_t(p)] != r.received_from[size_t(p)].load()) ahead.push_back(p);
  return ahead;
}

}  // namespace

void detail::agree_on_check_mode(Communicator& world, AgreementBoard* board, CheckMode mode,
                                 const char* op, const char* hint) {
  const std::vector<int> ahead = senders_ahead(world);
  // [mode, -mode]: equal maxima mean one mode; then the highest rank with a message in flight
  // to it, plus one (0: none).
  const auto wanted = static_cast<int64_t>(mode);
  int64_t v[3] = {wanted, -wanted, ahead.empty() ? 0 : runtime().rank + 1};
  max_words(world, board, v);
  WEAVE_CHECK(v[0] == -v[1], op, "the ranks use different check modes (this rank: {}); hint: {}",
              mode_name(mode), hint);
  WEAVE_CHECK(ahead.empty(), op,
              "ranks {} sent this rank point-to-point messages that no receive issued before {} "
              "takes; a receive issued after it would expect the other mode's message; hint: "
              "receive every message before switching",
              ahead, op);
  WEAVE_CHECK(v[2] == 0, op,
              "a point-to-point message to rank {} is in flight across {} (see that rank's "
              "error); hint: receive every message before switching",
              v[2] - 1, op);
}

CheckMode check_mode() {
  return runtime().check;
}

void detail::check_is_mode(CheckMode mode, const char* op) {
  WEAVE_CHECK(mode == CheckMode::Off || mode == CheckMode::Guard || mode == CheckMode::Full, op,
              "CheckMode({}) is not a check mode; hint: CheckMode::Off, Guard or Full",
              static_cast<int>(mode));
}

void set_check_mode(CheckMode mode) {
  Runtime& r = live("set_check_mode");
  const Group world_group = world();
  Call c(Op::SetCheckMode, world_group);
  // A refusal here still takes the call's turn (Call's destructor): the peers raise too.
  check_is_mode(mode, "set_check_mode");
  const std::vector<std::string> busy = groups_busy_elsewhere();
  WEAVE_CHECK(busy.empty(), "set_check_mode",
              "another thread of this rank is inside a call on group {} now; a switch would "
              "apply to some of its calls and not to the peers' same calls; hint: switch while "
              "no other thread communicates (join or pause it first)",
              fmt::join(busy, ", "));
  Fingerprint print;
  print.op = static_cast<int32_t>(c.op);
  print.rank = r.rank;
  issue(
      c, print, true,
      [&r, mode] {
        agree_on_check_mode(*r.world->comm, r.world->board.get(), mode, "set_check_mode",
                            "every rank must call set_check_mode with the same mode");
      },
      false);
  r.check = mode;
}

void realign(const Group& group) {
  Call c(Op::Realign, group);
  Group::Impl& g = member(c);
  c.issued = true;  // its rounds are its peers' news: nothing to report on a failure
  IssuingThread one_thread(g, c);
  g.drain();  // this rank's calls behind the mismatch fail against the peers' rounds, or pair
  const CheckMode mode = runtime().check;
  if (mode == CheckMode::Off) return;  // nothing was checked, so nothing is out of step
  Fingerprint round;  // sequence 0 and no step: every rank's round is the same call
  round.op = static_cast<int32_t>(Op::Realign);
  round.rank = runtime().rank;
  for (;;) {
    try {
      g.submit(
          round,
          [&g, round, mode] {
            agree(g, round, mode);
            // Calls the others issued and this rank did not (or the reverse) took numbers.
            auto next = static_cast<int64_t>(g.next_sequence.load());
            max_words(*g.comm, g.board.get(), std::span(&next, 1));
            g.next_sequence.store(static_cast<uint64_t>(next));
          },
          false);
      return;
    } catch (const Error&) {
      // This round met a peer's call that was issued before that peer reached realign (it
      // fails there too): meet again until every rank is realigning.
    }
  }
}

uint64_t disagreements(const Group& group) {
  return group.impl()->disagreements.load(std::memory_order_relaxed);
}

}  // namespace weave::dist

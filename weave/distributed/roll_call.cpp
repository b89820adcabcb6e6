// The roll call: when a call times out, the watchdog asks every other rank of the group, over the
// control communicator (its threads answer while their ranks sleep or compute), what it last
// issued there, and reports which ranks have not arrived and where each of them stands. A rank
// asked about a group in whose call it waits too reports at once, so every waiting rank tells
// its story before the job is torn down. The same question, as a probe, finds a deadlock
// sooner: a point-to-point call whose partner sits in a collective this rank cannot reach.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <thread>

#include "weave/distributed/runtime.h"

namespace weave::dist::detail {

namespace {

// Why a rank asks: the watchdog's probe for a deadlock (nothing is wrong yet), or the job is
// going down because its call timed out or can never complete.
enum class Asking : int64_t { Probe, TimedOut, CannotComplete };

// Sent as bytes between ranks of one build: the question (which group, the call the asking
// rank waits in, and why it asks) and the answer.
struct Question {
  int64_t group_id = -1;
  Fingerprint waiting_in;
  Asking asking = Asking::TimedOut;
};
struct Answer {
  int64_t group_id = -1;
  int64_t issued = -1;       // calls numbered on the group so far (-1: not a member)
  int64_t last_age_ns = -1;  // since the last call was issued (-1: none)
  Fingerprint last;
  int64_t running_since = 0;  // the call it runs on the group now (0: none), on its clock
  int64_t running_age_ns = -1;
  Fingerprint running;
  int64_t sends_in_flight = 0;  // isends not yet seen complete
};

// This rank tears the job down (time_out): the questions its peers ask then teach it nothing.
std::atomic<bool> tearing_down{false};
// A peer asked because it found a call of a group that can never complete.
std::atomic<bool> peer_found_deadlock{false};

template <class T>
std::string bytes_of(const T& value) {
  return std::string(reinterpret_cast<const char*>(&value), sizeof value);
}

std::shared_ptr<Group::Impl> find_group(int64_t id) {
  Runtime& r = runtime();
  std::lock_guard lock(r.groups_mutex);
  for (auto& weak : r.groups)
    if (auto g = weak.lock(); g && g->id == id && g->my_rank >= 0) return g;
  return nullptr;
}

std::string seconds(int64_t ns) {
  return fmt::format("{:.1f} s", double(ns) * 1e-9);
}

// Whether the answering rank has issued the call `running` (numbered on the group).
bool issued(const Answer& answer, const Fingerprint& running) {
  // realign's rounds all carry number 0, so the count cannot tell: a peer inside realign has
  // a round as its last call on the group (it issues the next one as soon as one fails).
  if (static_cast<Op>(running.op) == Op::Realign)
    return answer.last_age_ns >= 0 && answer.last.op == running.op;
  return answer.issued > int64_t(running.sequence);
}

// What one peer's answer says, or "" when it waits in the call too.
std::string verdict(int peer, const Answer* answer, const Fingerprint& running) {
  if (answer == nullptr)
    return fmt::format("rank {} did not answer (it died, or its process is stuck)", peer);
  const auto op = static_cast<Op>(running.op);
  if (op != Op::Send && op != Op::Recv && issued(*answer, running)) return "";
  const std::string last = answer->last_age_ns < 0
                               ? "has issued nothing on this group"
                               : fmt::format("last issued {} on this group, {} ago",
                                             describe(answer->last), seconds(answer->last_age_ns));
  switch (op) {
    case Op::Send:
    case Op::Recv:
      return fmt::format("rank {} {}", peer, last);
    case Op::Realign:
      return fmt::format("rank {} has not reached realign: it {}", peer, last);
    default:
      return fmt::format("rank {} has not arrived: it {}", peer, last);
  }
}

// Asks `peers` (world ranks) about group g, and waits up to a second for their answers
// (serving theirs).
std::map<int, Answer> ask(const Group::Impl& g, const Fingerprint& running,
                          const std::vector<int>& peers, Asking asking) {
  const Question question{.group_id = g.id, .waiting_in = running, .asking = asking};
  for (int peer : peers) mpi::send_control(peer, mpi::Control::RollCall, bytes_of(question));
  std::map<int, Answer> answers;
  const int64_t deadline = now_ns() + 1000000000;
  while (answers.size() < peers.size() && now_ns() < deadline) {
    serve_roll_calls();
    while (auto message = mpi::poll_control(mpi::Control::RollAnswer)) {
      Answer answer;
      if (message->second.size() != sizeof answer) continue;
      std::memcpy(&answer, message->second.data(), sizeof answer);
      if (answer.group_id == g.id) answers[message->first] = answer;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return answers;
}

std::string roll_call(const Group::Impl& g, const Fingerprint& running, Asking asking) {
  if (!runtime().uses_mpi || g.ranks.size() < 2) return "";
  std::vector<int> others;
  for (int peer : g.ranks)
    if (peer != runtime().rank) others.push_back(peer);
  const std::map<int, Answer> answers = ask(g, running, others, asking);
  std::vector<std::string> absent;
  std::vector<int> waiting = {runtime().rank};
  for (int peer : g.ranks) {
    if (peer == runtime().rank) continue;
    auto found = answers.find(peer);
    const std::string v = verdict(peer, found == answers.end() ? nullptr : &found->second, running);
    if (v.empty())
      waiting.push_back(peer);
    else
      absent.push_back(v);
  }
  std::sort(waiting.begin(), waiting.end());
  if (absent.empty())  // every rank waits in it: a peer stuck inside the library, or a network
    return "; roll call: every rank of the group is in this call";
  return fmt::format("; roll call: {}; ranks [{}] are in this call", fmt::join(absent, "; "),
                     fmt::join(waiting, ", "));
}

// Where this rank stands on group g: the answer to a roll call.
void describe_group(Group::Impl& g, Answer& answer) {
  {
    std::lock_guard lock(g.sends_mutex);
    for (const Work& w : g.sends_in_flight) answer.sends_in_flight += w.is_completed() ? 0 : 1;
  }
  std::lock_guard lock(g.mutex);
  answer.issued = static_cast<int64_t>(g.next_sequence.load());
  answer.last = g.last_issued;
  answer.last_age_ns = g.last_issued_ns == 0 ? -1 : now_ns() - g.last_issued_ns;
  answer.running_since = g.running_since.load();
  if (answer.running_since == 0) return;
  answer.running = g.running;
  answer.running_age_ns = now_ns() - answer.running_since;
}

// A partner seen inside a collective of the group that this rank has not issued, while this
// rank waits for it in a point-to-point call: the next probe must find both unchanged.
struct Suspicion {
  int64_t probed_ns = 0;
  int64_t my_call_since = 0;
  int peer = -1;
  int64_t peer_call_since = 0;
  bool operator==(const Suspicion&) const = default;
};

std::string deadlock_story(const Group::Impl& g, const Fingerprint& mine, int peer,
                           const Answer& theirs) {
  const std::string hint =
      mine.from_backward != 0
          ? fmt::format(
                "this rank issued its call from backward, so rank {}'s backward probably "
                "skipped a communicating node (ring attention's, a pipeline stage's); "
                "hint: call backward on every rank, also where the loss does not use "
                "the output (a rank without a loss: autograd::backward({{}}))",
                peer)
          : std::string(
                "hint: every rank must issue the group's collectives and point-to-point "
                "calls in one order");
  return fmt::format(
      "{} on group [{}] can never complete: rank {}, which it waits for, waits in {} on this "
      "group ({} so far), which this rank has not issued and can issue only after this call; {}",
      describe(mine), fmt::join(g.ranks, ", "), peer, describe(theirs.running),
      seconds(theirs.running_age_ns), hint);
}

}  // namespace

// The first question tells this rank that the job is going down: it writes its flight recorder
// and, when it has not issued the call the asking rank waits in, says so.
void learn_of_the_timeout(int asker, const Question& question, const Answer& answer) {
  static std::atomic<bool> told{false};
  if (tearing_down.load() || told.exchange(true)) return;
  const Fingerprint& waited = question.waiting_in;
  const std::string story =
      question.asking == Asking::CannotComplete
          ? fmt::format("rank {} waits in {}, which can never complete", asker, describe(waited))
          : fmt::format("rank {} timed out waiting in {}", asker, describe(waited));
  // A rank that waits in the call too writes its recorder as it times out (time_out).
  if (answer.issued < 0 || issued(answer, waited)) return;
  dump_flight_recorder(story);
  report(fmt::format(
      "{}, which this rank has not issued (its last call on that group: {}); the "
      "job is being torn down",
      story,
      answer.last_age_ns < 0
          ? std::string("none")
          : fmt::format("{}, {} ago", describe(answer.last), seconds(answer.last_age_ns))));
}

std::vector<int64_t> serve_roll_calls() {
  std::vector<int64_t> asked;
  while (auto request = mpi::poll_control(mpi::Control::RollCall)) {
    Question question;
    if (request->second.size() != sizeof question) continue;
    std::memcpy(&question, request->second.data(), sizeof question);
    Answer answer;
    answer.group_id = question.group_id;
    if (auto g = find_group(question.group_id)) describe_group(*g, answer);
    mpi::send_control(request->first, mpi::Control::RollAnswer, bytes_of(answer));
    if (question.asking == Asking::Probe) continue;  // nothing is wrong yet
    if (question.asking == Asking::CannotComplete) peer_found_deadlock.store(true);
    learn_of_the_timeout(request->first, question, answer);
    asked.push_back(answer.group_id);
  }
  return asked;
}

std::string find_deadlock(Group::Impl& g) {
  static std::map<int64_t, Suspicion> suspicions;  // by group id; the watchdog's own
  Fingerprint mine;
  {
    std::lock_guard lock(g.mutex);
    mine = g.running;
  }
  const int64_t since = g.running_since.load();
  const auto op = static_cast<Op>(mine.op);
  const std::vector<int> peers = partners_of(g, mine);
  Suspicion& seen = suspicions[g.id];
  const int64_t now = now_ns();
  if (!runtime().uses_mpi || since == 0 || (op != Op::Send && op != Op::Recv) || peers.empty() ||
      now - since < kProbeAfterNs || now - seen.probed_ns < kProbeAfterNs)
    return "";
  const uint64_t issued_here = g.next_sequence.load();
  for (const auto& [peer, theirs] : ask(g, mine, peers, Asking::Probe)) {
    const auto op_there = static_cast<Op>(theirs.running.op);
    if (theirs.running_since == 0 || op_there == Op::Send || op_there == Op::Recv ||
        theirs.sends_in_flight != 0 || theirs.running.sequence < issued_here)
      continue;
    const Suspicion now_seen{seen.probed_ns, since, peer, theirs.running_since};
    if (seen == now_seen) return deadlock_story(g, mine, peer, theirs);
    seen = now_seen;  // once is not enough: a message may be on its way; look again
    seen.probed_ns = now_ns();
    return "";
  }
  seen = {.probed_ns = now_ns()};
  return "";
}

std::vector<int> partners_of(const Group::Impl& g, const Fingerprint& call) {
  std::vector<int> world;
  for (int64_t peer : {int64_t(call.root), call.extra - 1})  // extra: send_recv's source + 1
    if (peer >= 0 && peer < int64_t(g.ranks.size()) && g.ranks[size_t(peer)] != runtime().rank &&
        std::find(world.begin(), world.end(), g.ranks[size_t(peer)]) == world.end())
      world.push_back(g.ranks[size_t(peer)]);
  return world;
}

void time_out(Group::Impl& g, bool asked_by_peer, const std::string& deadlock) {
  Fingerprint running;
  {
    std::lock_guard lock(g.mutex);
    running = g.running;
  }
  const Runtime& r = runtime();
  const int64_t ran = now_ns() - g.running_since.load();
  const std::string what =
      fmt::format("{} on group [{}]", describe(running), fmt::join(g.ranks, ", "));
  tearing_down.store(true);
  const bool cannot_complete = !deadlock.empty() || (asked_by_peer && peer_found_deadlock.load());
  std::string why = deadlock;
  if (why.empty() && cannot_complete)
    why = fmt::format(
        "{} has run for {}; a peer found that a call of this group can never "
        "complete (its report says which)",
        what, seconds(ran));
  else if (why.empty() && asked_by_peer)
    why = fmt::format("{} has run for {}; a peer's wait in it passed WEAVE_TIMEOUT_S ({} s)", what,
                      seconds(ran), r.timeout_s);
  else if (why.empty())
    why = fmt::format("{} did not complete within {} s (WEAVE_TIMEOUT_S)", what, r.timeout_s);
  const std::string story =
      why + roll_call(g, running, cannot_complete ? Asking::CannotComplete : Asking::TimedOut);
  dump_flight_recorder(story);
  report(story + "; tearing the job down");
  // The peers that time out a moment later still get their answers before the job goes.
  for (const int64_t until = now_ns() + 1000000000; now_ns() < until;) {
    if (r.uses_mpi) serve_roll_calls();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (r.uses_mpi) mpi::abort_job(1);
  std::_Exit(1);
}

}  // namespace weave::dist::detail

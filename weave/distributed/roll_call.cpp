// The roll call: when a call times out, the watchdog asks every other rank of the group, over the
// control communicator (its threads answer while their ranks sleep or compute), what it last
// issued there, and reports which ranks have not arrived and where each of them stands. A rank
// asked about a group in whose call it waits too reports at once, so every waiting rank tells
// its story before the job is torn down.
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <thread>

#include "weave/distributed/runtime.h"

namespace weave::dist::detail {

namespace {

// Sent as bytes between ranks of one build: the question (which group, and the call the asking
// rank waits in) and the answer.
struct Question {
  int64_t group_id = -1;
  Fingerprint waiting_in;
};
struct Answer {
  int64_t group_id = -1;
  int64_t issued = -1;       // calls numbered on the group so far (-1: not a member)
  int64_t last_age_ns = -1;  // since the last call was issued (-1: none)
  Fingerprint last;
};

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
    case Op::Recv: return fmt::format("rank {} {}", peer, last);
    case Op::Realign: return fmt::format("rank {} has not reached realign: it {}", peer, last);
    default: return fmt::format("rank {} has not arrived: it {}", peer, last);
  }
}

// Asks the group's other ranks, and waits up to a second for their answers (serving theirs).
std::map<int, Answer> ask(const Group::Impl& g, const Fingerprint& running) {
  const int me = runtime().rank;
  const Question question{.group_id = g.id, .waiting_in = running};
  for (int peer : g.ranks)
    if (peer != me) mpi::send_control(peer, mpi::Control::RollCall, bytes_of(question));
  std::map<int, Answer> answers;
  const int64_t deadline = now_ns() + 1000000000;
  while (answers.size() + 1 < g.ranks.size() && now_ns() < deadline) {
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

std::string roll_call(const Group::Impl& g, const Fingerprint& running) {
  if (!runtime().uses_mpi || g.ranks.size() < 2) return "";
  const std::map<int, Answer> answers = ask(g, running);
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

}  // namespace

// The first question tells this rank that the job is going down: it writes its flight recorder
// and, when it has not issued the call the asking rank waits in, says so.
void learn_of_the_timeout(int asker, const Question& question, const Answer& answer) {
  static std::atomic<bool> told{false};
  if (told.exchange(true)) return;
  const Fingerprint& waited = question.waiting_in;
  const std::string story = fmt::format("rank {} timed out waiting in {}", asker, describe(waited));
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
    if (auto g = find_group(question.group_id)) {
      std::lock_guard lock(g->mutex);
      answer.issued = static_cast<int64_t>(g->next_sequence.load());
      answer.last = g->last_issued;
      answer.last_age_ns = g->last_issued_ns == 0 ? -1 : now_ns() - g->last_issued_ns;
    }
    mpi::send_control(request->first, mpi::Control::RollAnswer, bytes_of(answer));
    learn_of_the_timeout(request->first, question, answer);
    asked.push_back(answer.group_id);
  }
  return asked;
}

void time_out(Group::Impl& g, bool asked_by_peer) {
  Fingerprint running;
  {
    std::lock_guard lock(g.mutex);
    running = g.running;
  }
  const Runtime& r = runtime();
  const int64_t ran = now_ns() - g.running_since.load();
  const std::string what =
      fmt::format("{} on group [{}]", describe(running), fmt::join(g.ranks, ", "));
  const std::string why =
      asked_by_peer
          ? fmt::format("{} has run for {}; a peer's wait in it passed WEAVE_TIMEOUT_S ({} s)",
                        what, seconds(ran), r.timeout_s)
          : fmt::format("{} did not complete within {} s (WEAVE_TIMEOUT_S)", what, r.timeout_s);
  const std::string story = why + roll_call(g, running);
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

#pragma once
// Where agreement rounds meet when a group's ranks share a machine (internal). Each round
// (agreement.h: the maximum of kRoundWords int64 over the ranks) is a message exchange in MPI:
// an all_reduce of 120 bytes. On a board of cache lines that every rank maps, a round is one
// store and one load per peer, no message, and gives the same maximum (the whole guard, hash
// and round, measured 0.3-0.5 µs per call at two ranks by bench_collectives on 2026-11-27).
// Groups whose ranks cannot map one board (other machines or network namespaces, no /dev/shm,
// more than kMaxRanks ranks) keep the all_reduce.
//
// Each rank owns two slots, one for odd rounds and one for even: a rank can be at most one
// round ahead of the slowest (it cannot finish round r + 1 before every rank posted r + 1,
// which each does only after reading all of round r), so a slot is never rewritten before
// every peer read it.
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "weave/distributed/communicator.h"

namespace weave::dist::detail {

class AgreementBoard {
 public:
  /// Larger groups keep the all_reduce: each round reads every peer's slot, which grows
  /// linearly where the all_reduce grows with log2 of the ranks.
  static constexpr int kMaxRanks = 32;
  /// The words of one round: a slot is one 128-byte line, its first word the round number.
  static constexpr size_t kRoundWords = 15;

  /// Collective over `host`: a board that every rank of it mapped, or null on every rank when
  /// one could not (the ranks then agree through host.all_reduce). Never raises for a board
  /// that cannot be made, only for a failing host communicator. `cores_shared`: the machine
  /// runs more ranks than it has cores, so a waiting rank yields its core (see max()).
  static std::unique_ptr<AgreementBoard> connect(Communicator& host, bool cores_shared);

  /// The parts connect() is made of, for a test that plays every rank in one process: `ranks`
  /// slots in a new shared-memory segment (null if none can be made; name() and nonce() open
  /// it), and the same segment mapped by rank `me`, if it exists and carries `nonce`.
  /// The name is /weave-agree-<pid>-<n>-<64 random bits>: no other local user can guess it and
  /// take it first. Segments that killed jobs left behind are swept first (sweep_dead_segments).
  static std::unique_ptr<AgreementBoard> create(int ranks);
  static std::unique_ptr<AgreementBoard> open(const std::string& name, uint64_t nonce, int ranks,
                                              int me);

  /// Unlinks the boards in /dev/shm whose creating process no longer exists.
  static void sweep_dead_segments();

  ~AgreementBoard();
  AgreementBoard(const AgreementBoard&) = delete;
  AgreementBoard& operator=(const AgreementBoard&) = delete;

  /// The element-wise maximum of `values` over every rank's values of this round, as
  /// all_reduce(Max) would give. Blocks until every rank posted them: spinning (yielding after
  /// a microsecond when cores are shared), then, after 5 ms, sleeping 50 µs at a time. A rank
  /// that never comes is the watchdog's to report, as in any collective.
  void max(std::span<int64_t, kRoundWords> values);
  /// Yield while waiting (ranks that share cores) instead of spinning; connect() sets it.
  void set_cores_shared(bool shared) { cores_shared_ = shared; }

  const std::string& name() const { return name_; }
  uint64_t nonce() const { return nonce_; }
  /// Removes the segment's name (the mappings stay): once every rank has opened it.
  void unlink();

 private:
  AgreementBoard(std::string name, void* memory, int ranks, int me);
  uint64_t* slot(uint64_t round, int rank) const;

  std::string name_;
  bool named_ = false;  // this process created the name and has not unlinked it
  void* memory_ = nullptr;
  int ranks_ = 0, me_ = 0;
  uint64_t nonce_ = 0;
  uint64_t round_ = 0;
  bool cores_shared_ = false;
};

}  // namespace weave::dist::detail

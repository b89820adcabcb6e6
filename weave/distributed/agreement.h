#pragma once
// The one way ranks agree (internal): the element-wise maximum of a few int64 words over a
// group's ranks. A maximum answers every agreement question weave asks: "did every rank
// succeed?" (the maximum of failure flags), "did every rank pass the same value?" (the maxima of
// v and -v are equal), "what is every rank's small plan?" (each rank fills its own row, zeros
// elsewhere). The collective guard (fingerprint.h) rides in the first round of every call.
//
// Transport: on the group's agreement board when its ranks share a machine (one store and one
// load per peer for each round of kRoundWords words), else one all_reduce over the host
// communicator. The first round always carries exactly kRoundWords words on either transport,
// so a rank whose call failed before it could say how many words it meant (it sends the guard's
// words only) still meets its peers' first round, and they all raise there.
#include <cstdint>
#include <span>

#include "weave/distributed/agreement_board.h"
#include "weave/distributed/communicator.h"

namespace weave::dist::detail {

/// Words per round: a cache line of the board, less the round number.
inline constexpr size_t kRoundWords = AgreementBoard::kRoundWords;

/// One round: `round` becomes the element-wise maximum over the ranks of `host`.
void max_round(Communicator& host, AgreementBoard* board, std::span<int64_t, kRoundWords> round);

/// Any number of words (every rank the same number): rounds of kRoundWords on the board, or one
/// all_reduce over `host`.
void max_words(Communicator& host, AgreementBoard* board, std::span<int64_t> words);

}  // namespace weave::dist::detail

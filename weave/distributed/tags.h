#pragma once
// The point-to-point message tags weave itself sends with, in one place. Sends and receives
// pair by (group, peer, tag) in order, so two kinds of message between the same two ranks must
// never share a tag: one kind's receive would take the other's message. User code may use any
// tag below kFirstReserved on its own sends.
namespace weave::dist::tags {

/// Tags from here up are weave's (MPI guarantees tags up to 32767).
inline constexpr int kFirstReserved = 30000;

/// dist::functional's remote_send / remote_recv: values forward, their gradients backward.
inline constexpr int kRemoteForward = kFirstReserved + 1;
inline constexpr int kRemoteBackward = kFirstReserved + 2;
/// Pipeline stages: gradients sent back alone, a send and a receive fused into one exchange
/// (1F1B's steady state), and the grouped exchange of a whole schedule step.
inline constexpr int kPipelineGradient = kFirstReserved + 10;
inline constexpr int kPipelineExchange = kFirstReserved + 11;
inline constexpr int kPipelineStep = kFirstReserved + 12;
/// Ring attention: key/value blocks travelling the ring, and the dK/dV accumulated with them.
inline constexpr int kRingKeyValue = kFirstReserved + 20;
inline constexpr int kRingGradient = kFirstReserved + 21;

}  // namespace weave::dist::tags

#pragma once
// What every collective and point-to-point front end shares (internal): argument checks, the
// staging of a tensor to the buffer its backend moves (host memory under MPI, the tensor itself
// when it already is that), landing the result back, and the call's fingerprint for the guard.
#include <optional>

#include "weave/distributed/runtime.h"

namespace weave::dist::detail {

/// Raises unless root is a position in the call's group.
void check_root(const Call& c, int root);
/// Raises for an undefined tensor, one on another NCCL device, or one too large to move.
void check_tensor(const Call& c, const Tensor& t, const char* what);
/// Raises unless input and output share dtype and device.
void check_same(const Call& c, const Tensor& a, const Tensor& b);

/// The device a backend moves t's bytes from: t's own under NCCL, else the host.
Device wire_device(const Tensor& t);
/// t itself when it already is a contiguous wire buffer, else `stage`, made a copy of t on the
/// wire device. The reference form spares the latency path a handle copy.
const Tensor& staged(const Tensor& t, Tensor& stage);
Tensor staged(const Tensor& t);
/// Like staged, for an output: `stage` is a buffer only, nothing copied in.
const Tensor& staging_for(const Tensor& t, Tensor& stage);
Tensor staging_for(const Tensor& t);
/// Copies a staged result into target (unless it is target) and bumps target's version.
void land(const Tensor& stage, const Tensor& target);

/// Where a receiver puts a tensor sent from a device of type `sent_from`: the CPU for a CPU
/// tensor, else this rank's GPU (raises on a rank without one).
Device receiving_device(DeviceType sent_from, const char* op);

/// What the guard compares across ranks for this call.
Fingerprint fingerprint(const Call& c, uint64_t sequence, const Tensor* shape_of, int root,
                        std::optional<ReduceOp> reduce_op, bool uneven_first_dim);

}  // namespace weave::dist::detail

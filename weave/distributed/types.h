#pragma once
// The small vocabulary shared by the public API and the backend interface.

namespace weave::dist {

/// Which library moves CUDA tensors: MPI (staged through host memory) or NCCL. CPU tensors
/// always travel over MPI.
enum class Backend { MPI, NCCL };
/// Reduction of a collective. Avg is a sum divided by the group size (floating dtypes only).
enum class ReduceOp { Sum, Prod, Min, Max, Avg };

}  // namespace weave::dist

#pragma once
// The MPI backend's errors, datatypes and reduction ops (internal).
#include <mpi.h>

#include <string>

#include "weave/distributed/types.h"
#include "weave/tensor/dtype.h"
#include "weave/tensor/error.h"
#include "weave/tensor/process_memory.h"

namespace weave::detail {
// MPI calls return an int error code (communicators here return errors, not abort).
inline bool call_succeeded(int code) {
  return code == MPI_SUCCESS;
}
// Open MPI reports a buffer or shared-memory segment it could not get as an internal error or
// as no memory: say it may be memory, with what this rank holds and its limit.
inline std::string call_error(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0, error_class = MPI_SUCCESS;
  MPI_Error_string(code, text, &length);
  MPI_Error_class(code, &error_class);
  std::string out = fmt::format("{} (MPI error {})", std::string(text, length), code);
  if (error_class == MPI_ERR_INTERN || error_class == MPI_ERR_NO_MEM)
    out += fmt::format(
        "; this may be memory: {}; hint: MPI maps buffers and shared memory beyond the tensors "
        "(docs/memory.md sizes an address-space limit), so raise the limit, shard over more "
        "ranks, or send large collectives in smaller chunks (WEAVE_MPI_CHUNK_MB)",
        describe_process_memory());
  return out;
}
}  // namespace weave::detail

namespace weave::dist::detail {

/// Creates the 16-bit types and the ops on them (once; MPI initialized).
void create_16bit_types();
MPI_Datatype mpi_type(DType dtype);
MPI_Op mpi_op(ReduceOp op, DType dtype);
/// The mean of two ranks' values as one reduction (communicators of two ranks only).
MPI_Op mean_of_two_op();

}  // namespace weave::dist::detail

// Stand-in when weave is built without MPI: every process is a world of one.
#include <cstdlib>

#include "weave/distributed/communicator.h"

namespace weave::dist::detail::mpi {

bool launched() {
  WEAVE_CHECK(std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr && std::getenv("PMIX_RANK") == nullptr,
              "init",
              "started by an MPI launcher, but weave was built without MPI; hint: install "
              "libopenmpi-dev and configure with -DWEAVE_WITH_MPI=ON");
  return false;
}
std::unique_ptr<Communicator> init_world() {
  WEAVE_FAIL("init", "weave was built without MPI");
}
int local_rank() {
  return 0;
}
void finalize() {}
void abort_job(int code) {
  std::_Exit(code);
}
bool farewell(int64_t) {
  return true;
}

}  // namespace weave::dist::detail::mpi

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
bool cores_shared() {
  return false;
}
void finalize() {}
void abort_job(int code) {
  std::_Exit(code);
}
bool farewell(int64_t, std::string*) {
  return true;
}
void announce_leaving(const std::vector<int64_t>&) {}
std::optional<std::pair<int, std::vector<int64_t>>> poll_leaving() {
  return std::nullopt;
}
void finish_leaving(int) {}
void report_waiting(int, const std::string&) {}
void send_control(int, Control, std::string) {}
std::optional<std::pair<int, std::string>> poll_control(Control) {
  return std::nullopt;
}

}  // namespace weave::dist::detail::mpi

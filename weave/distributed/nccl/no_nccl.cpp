// Stand-in when weave is built without NCCL.
#include "weave/distributed/communicator.h"

namespace weave::dist::detail::nccl {

bool available() {
  return false;
}
std::unique_ptr<Communicator> init_world(Communicator&, int) {
  WEAVE_FAIL("init",
             "weave was built without NCCL; hint: configure with -DWEAVE_WITH_CUDA=ON "
             "-DWEAVE_WITH_NCCL=ON, or use Backend::MPI");
}

}  // namespace weave::dist::detail::nccl

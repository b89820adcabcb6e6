// A rank that skips a collective: the others must fail within WEAVE_TIMEOUT_S (+ slack) with
// a message naming the op, its sequence number, the group, dtype and shape -- never hang.
#include <chrono>
#include <thread>

#include "weave/distributed/distributed.h"
#include "weave/ops/ops.h"

using namespace weave;

int main() {
  dist::init(dist::Backend::MPI);
  Tensor t = ones({4, 5});
  dist::all_reduce(t);                         // everyone: #0
  if (dist::rank() != 1) dist::all_reduce(t);  // rank 1 skips #1
  std::this_thread::sleep_for(std::chrono::seconds(60));
  dist::finalize();
  return 0;
}

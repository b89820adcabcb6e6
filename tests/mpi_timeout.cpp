// Failures that must end the job within WEAVE_TIMEOUT_S (+ slack), never hang:
//   weave_mpi_timeout                      rank 1 skips a collective: the others fail with a
//                                          message naming the op, sequence number, group,
//                                          dtype and shape
//   weave_mpi_timeout pipeline-throw       a pipeline stage throws mid-schedule (uncaught)
//   weave_mpi_timeout pipeline-throw-caught   ... and main catches it and returns 1
//   weave_mpi_timeout slow-peer            a healthy job whose barrier waits 0.5 s for a rank:
//                                          must succeed under any WEAVE_TIMEOUT_S above that
//                                          (1e10 and inf once overflowed into an instant abort)
// and the fault matrix (scripts/fault-matrix.sh), rank 1 failing while the others are inside a
// collective:
//   weave_mpi_timeout exception            throws; main catches it outside the InitGuard
//   weave_mpi_timeout kill                 SIGKILL
//   weave_mpi_timeout exit                 exit(1)
//   weave_mpi_timeout return-early         returns from main (its InitGuard finalizes)
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "weave/weave.h"

using namespace weave;

namespace {

// Raises in the forward of its third micro-batch on the stage that owns it.
class FailingLayer : public nn::Module {
 public:
  FailingLayer() : nn::Module("FailingLayer"), scale(register_parameter("scale", ones({1}))) {}
  Tensor forward(const Tensor& x) override {
    WEAVE_CHECK(++calls_ < 3, "FailingLayer", "stage failed on purpose at micro-batch {}", calls_);
    return x * scale;
  }
  Tensor& scale;

 private:
  int calls_ = 0;
};

int skip_collective() {
  dist::init(dist::Backend::MPI);
  Tensor t = ones({4, 5});
  dist::all_reduce(t);                         // everyone: #0
  if (dist::rank() != 1) dist::all_reduce(t);  // rank 1 skips #1
  std::this_thread::sleep_for(std::chrono::seconds(60));
  dist::finalize();
  return 0;
}

void pipeline_with_a_failing_stage() {
  const int n = dist::world_size();
  nn::Sequential model;
  for (int i = 0; i < n; ++i)
    if (i == 1)
      model.push_back(std::make_shared<FailingLayer>());
    else
      model.push_back(std::make_shared<nn::Linear>(4, 4));
  auto stage = parallel::pipeline_stage(model, dist::rank(), n);
  parallel::Pipeline pipe(*stage, {.schedule = parallel::Schedule::OneFOneB, .microbatches = 4});
  pipe.train_step(ones({8, 4}), zeros({8, 4}),
                  [](const Tensor& out, const Tensor& y) { return mse_loss(out, y); });
  std::this_thread::sleep_for(std::chrono::seconds(60));
}

// Rank 1 fails in the way `mode` names after the first collective; the others go on to the
// next one and wait there.
int fault(const std::string& mode) {
  try {
    dist::InitGuard guard;
    Tensor t = ones({4, 5});
    dist::all_reduce(t);
    if (dist::rank() == 1) {
      if (mode == "exception") WEAVE_FAIL("train", "rank 1 failed on purpose");
      if (mode == "kill") std::raise(SIGKILL);
      if (mode == "exit") std::exit(1);
      if (mode == "return-early") return 0;
    }
    dist::all_reduce(t);
    std::this_thread::sleep_for(std::chrono::seconds(60));
  } catch (const std::exception& e) {
    std::printf("rank %d: error: %s\n", dist::initialized() ? dist::rank() : -1, e.what());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode.empty() || mode == "skip") return skip_collective();
  if (mode == "exception" || mode == "kill" || mode == "exit" || mode == "return-early")
    return fault(mode);
  dist::InitGuard guard;
  if (mode == "slow-peer") {
    if (dist::rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    dist::barrier();
    if (dist::rank() == 0) std::printf("slow-peer: done\n");
    return 0;
  }
  if (mode == "pipeline-throw") pipeline_with_a_failing_stage();
  try {
    pipeline_with_a_failing_stage();
  } catch (const std::exception& e) {
    std::printf("rank %d: error: %s\n", dist::rank(), e.what());
    std::fflush(stdout);
    return 1;
  }
  return 0;
}

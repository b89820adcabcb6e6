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
// and the training faults of the matrix, each ending on every rank within seconds:
//   weave_mpi_timeout uneven               DDP training, rank 1 has one batch fewer (no join):
//                                          both ranks report the steps each reached
//   weave_mpi_timeout uneven-join          the same inside parallel::join(): trains, exit 0
//   weave_mpi_timeout backward-exception   rank 1's backward throws (uncaught) in step 2
//   weave_mpi_timeout ddp-unused           rank 1 leaves a parameter without gradient
//   weave_mpi_timeout pipeline-options     the stages disagree on the number of micro-batches
//   weave_mpi_timeout fsdp-forward         FSDP training, rank 1's forward raises in step 2
//   weave_mpi_timeout fsdp-backward        ... its backward raises in step 2
//   weave_mpi_timeout fsdp-kill            ... it is SIGKILLed in step 2's backward, once its
//                                          first reduce_scatter is out (the other waits in one)
// and the roll call (with the flight recorder), at 4 ranks:
//   weave_mpi_timeout late-rank            rank 2 sleeps before all_reduce #12: every waiting
//                                          rank names it and its last call (#11)
//   weave_mpi_timeout late-realign         ... rank 2 never reaches dist::realign: the others,
//                                          inside it, say so (not "every rank is in this call")
// and errors that main catches with its InitGuard alive, ended by dist::exit_with_error, which
// prints each distinct message once for the job (error_report_test.sh, at 4 ranks):
//   weave_mpi_timeout same-error           every rank raises one refusal
//   weave_mpi_timeout distinct-error       ... but rank 2 raises another
//   weave_mpi_timeout one-rank-error       rank 1 alone raises; the others wait in a collective
// and a skipped communicating backward, ended in seconds (WEAVE_TIMEOUT_S=60), at 2 and 3 ranks:
//   weave_mpi_timeout ring-skip            rank 1 skips a ring attention's backward and runs
//                                          the next forward: the others, in the ring's
//                                          exchange, find it in a collective they cannot reach
//   weave_mpi_timeout ring-skip-finalize   ... and leaves instead: the others learn it at once
// and a checkpoint that must not be lost behind a zero exit:
//   weave_mpi_timeout async-save-fails     rank 1's background write fails; the commit that
//                                          finalize() runs fails on every rank: exit non-zero
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>

#include <unistd.h>

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

// Passes its input on, detached when `cut` (the layers before it get no gradient).
class CutGradient : public nn::Module {
 public:
  explicit CutGradient(bool cut) : nn::Module("CutGradient"), cut_(cut) {}
  Tensor forward(const Tensor& x) override { return cut_ ? x.detach() : x; }

 private:
  bool cut_;
};

// DDP on a small model; rank r trains on 5 - r batches (rank 1 has one fewer), inside join()
// or not. A backward that throws on rank 1 in step 2 (`throw_in_backward`), or a layer that rank
// 1 leaves unused (`skip_layer`), are the other faults.
struct TrainingFault {
  bool use_join = false, throw_in_backward = false, skip_layer = false;
};

int train_with_fault(TrainingFault fault) {
  dist::InitGuard guard;
  manual_seed(1);
  auto first = std::make_shared<nn::Linear>(4, 8);
  const bool faulty = dist::rank() == 1;
  auto cut = std::make_shared<CutGradient>(fault.skip_layer && faulty);
  nn::Sequential model{first, cut, nn::Tanh(), std::make_shared<nn::Linear>(8, 2)};
  parallel::DistributedDataParallel ddp(model);
  optim::SGD sgd(model.parameters(), {.lr = 0.1});
  HookHandle hook = first->parameters()[0].register_post_accumulate_grad_hook([&](Tensor&) {
    if (fault.throw_in_backward && faulty && ddp.stats().steps == 2)
      WEAVE_FAIL("train", "rank 1's backward failed on purpose in step 2");
  });
  auto loop = [&] {
    const int batches = 5 - dist::rank();
    for (int step = 0; step < batches; ++step) {
      Generator g(uint64_t(step) * 10 + uint64_t(dist::rank()));
      Tensor x = randn({6, 4}, {}, &g), y = randn({6, 2}, {}, &g);
      sgd.zero_grad(false);
      mse_loss(ddp(x), y).backward();
      sgd.step();
    }
  };
  if (fault.use_join)
    parallel::join({ddp, sgd}, loop);
  else
    loop();
  std::printf("rank %d: trained %lld steps\n", dist::rank(),
              static_cast<long long>(ddp.stats().steps));
  return 0;
}

// FSDP on a small model, rank 1 failing in step 2 as `mode` says (uncaught).
int fsdp_fault(const std::string& mode) {
  dist::InitGuard guard;
  manual_seed(1);
  auto first = std::make_shared<nn::Linear>(4, 8), last = std::make_shared<nn::Linear>(8, 2);
  nn::Sequential model{first, nn::Tanh(), last};
  parallel::FullyShardedDataParallel fsdp(model);
  optim::SGD sgd(fsdp.parameters(), {.lr = 0.1});
  const bool faulty = dist::rank() == 1;
  int step = 0;
  HookHandle pre = last->register_forward_pre_hook([&](nn::Module&, const Tensor&) -> Tensor {
    if (faulty && step == 2 && mode == "fsdp-forward")
      WEAVE_FAIL("train", "rank 1's forward failed on purpose in step 2");
    return Tensor();
  });
  // The first layer's gradient comes after the last unit's reduce_scatter was launched.
  HookHandle post = first->weight.register_post_accumulate_grad_hook([&](Tensor&) {
    if (!faulty || step != 2) return;
    if (mode == "fsdp-backward")
      WEAVE_FAIL("train", "rank 1's backward failed on purpose in step 2");
    if (mode == "fsdp-kill") std::raise(SIGKILL);
  });
  for (; step < 5; ++step) {
    Generator g(uint64_t(step) * 10 + uint64_t(dist::rank()));
    Tensor x = randn({6, 4}, {}, &g), y = randn({6, 2}, {}, &g);
    sgd.zero_grad();
    mse_loss(fsdp(x), y).backward();
    sgd.step();
  }
  std::printf("rank %d: trained %d steps\n", dist::rank(), step);
  return 0;
}

// Rank 1's part of an asynchronous save cannot be written (a directory holds its file's name);
// main returns, and the InitGuard's finalize() commits the save: it must fail on every rank.
int failed_async_save() {
  dist::InitGuard guard;
  nn::Linear model(4, 4);
  data::TrainingState state{.model = &model};
  Tensor id = full({1}, double(getpid()), {.dtype = kInt64});
  dist::broadcast(id, 0);
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    fmt::format("weave_failed_save_{}", id.item<int64_t>());
  struct RemoveAtExit {  // a static's destructor: runs at exit() too
    std::filesystem::path dir;
    ~RemoveAtExit() {
      std::error_code ignored;
      std::filesystem::remove_all(dir, ignored);
    }
  };
  static RemoveAtExit cleanup{dist::rank() == 0 ? dir : std::filesystem::path()};
  if (dist::rank() == 0)
    std::filesystem::create_directories(
        dir / fmt::format("rank-00001-of-{:05d}.g1.safetensors", dist::world_size()));
  dist::barrier();
  parallel::save_sharded_checkpoint(dir.string(), state, dist::world(), {.async = true});
  std::printf("rank %d: save started\n", dist::rank());
  return 0;
}

// Every rank (or rank 1 alone) raises; main catches and ends the job with exit_with_error.
// Rank 1 skips the backward of a step with ring attention; then it runs the next step's
// forward (ring-skip) or leaves (ring-skip-finalize). Its peers wait in the ring's exchanges
// from backward: both must end in seconds, not at WEAVE_TIMEOUT_S, naming rank 1.
int ring_skip(const std::string& mode) {
  dist::InitGuard guard;
  Tensor w = ones({1, 2, 4, 8}).requires_grad_();
  for (int step = 0; step < 2; ++step) {
    const Tensor q = w * 1.0;
    const Tensor loss = parallel::ring_attention(q, q, q, dist::world(), {.causal = true}).sum();
    if (dist::rank() == 1 && step == 0) {
      if (mode == "ring-skip-finalize") return 0;
      continue;
    }
    loss.backward();
  }
  return 0;
}

int caught_error(const std::string& mode) {
  dist::InitGuard guard;
  try {
    Tensor t = ones({4});
    dist::all_reduce(t);
    if (mode == "one-rank-error" && dist::rank() != 1) {
      dist::all_reduce(t);  // waits for rank 1, which never comes
      std::this_thread::sleep_for(std::chrono::seconds(60));
      return 0;
    }
    const bool distinct = mode == "distinct-error" && dist::rank() == 2;
    WEAVE_CHECK(distinct, "train", "expected a batch of 8 rows, found 7; hint: drop_last");
    WEAVE_FAIL("train", "rank 2 has no shard of the data");
  } catch (const std::exception& e) {
    dist::exit_with_error(e);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode.empty() || mode == "skip") return skip_collective();
  if (mode == "exception" || mode == "kill" || mode == "exit" || mode == "return-early")
    return fault(mode);
  if (mode == "uneven") return train_with_fault({});
  if (mode == "uneven-join") return train_with_fault({.use_join = true});
  if (mode == "backward-exception") return train_with_fault({.throw_in_backward = true});
  if (mode == "ddp-unused") return train_with_fault({.skip_layer = true});
  if (mode.rfind("fsdp-", 0) == 0) return fsdp_fault(mode);
  if (mode == "async-save-fails") return failed_async_save();
  if (mode == "ring-skip" || mode == "ring-skip-finalize") return ring_skip(mode);
  if (mode == "same-error" || mode == "distinct-error" || mode == "one-rank-error")
    return caught_error(mode);
  if (mode == "pipeline-options") {
    dist::InitGuard guard;
    nn::Sequential model;
    for (int i = 0; i < dist::world_size(); ++i)
      model.push_back(std::make_shared<nn::Linear>(4, 4));
    auto stage = parallel::pipeline_stage(model, dist::rank(), dist::world_size());
    parallel::Pipeline pipe(*stage, {.microbatches = dist::rank() == 1 ? 4 : 2});
    return 0;
  }
  dist::InitGuard guard;
  if (mode == "uncaught") WEAVE_FAIL("train", "rank {} failed on purpose, uncaught", dist::rank());
  if (mode == "deferred-draw") {  // FSDP draws a deferred model: long, silent, and alive
    const int64_t width = argc > 2 ? std::atoll(argv[2]) : 2048;
    const int64_t layers = argc > 3 ? std::atoll(argv[3]) : 8;
    auto model = std::make_shared<nn::Sequential>();
    {
      nn::DeferredInit deferred(1);
      for (int64_t i = 0; i < layers; ++i)
        model->push_back(std::make_shared<nn::Linear>(width, width));
    }
    const auto start = std::chrono::steady_clock::now();
    parallel::FullyShardedDataParallel fsdp(*model);
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    std::printf("deferred-draw: %.2f s\n", took.count());
    return 0;
  }
  if (mode == "slow-peer") {
    if (dist::rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    dist::barrier();
    if (dist::rank() == 0) std::printf("slow-peer: done\n");
    return 0;
  }
  if (mode == "late-rank") {  // rank 2 sleeps before all_reduce #12: the roll call names it
    Tensor t = ones({4});
    for (int i = 0; i < 12; ++i) dist::all_reduce(t);
    if (dist::rank() == 2) std::this_thread::sleep_for(std::chrono::seconds(60));
    if (dist::rank() == 0) {
      const auto since_epoch = std::chrono::system_clock::now().time_since_epoch();
      std::printf("late-rank: waits from %lld ms\n",
                  static_cast<long long>(
                      std::chrono::duration_cast<std::chrono::milliseconds>(since_epoch).count()));
      std::fflush(stdout);
    }
    dist::all_reduce(t);
    return 0;
  }
  if (mode == "late-realign") {  // rank 2 never reaches realign: the roll call names it
    Tensor t = ones({4});
    for (int i = 0; i < 12; ++i) dist::all_reduce(t);
    if (dist::rank() == 2) std::this_thread::sleep_for(std::chrono::seconds(60));
    dist::realign();
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

// doctest runner for MPI tests: every rank runs every test; rank 0 prints each failing rank's
// report and a summary naming the failing ranks; the exit code is non-zero if any rank failed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>

#include "weave/distributed/distributed.h"
#include "weave/ops/ops.h"
#include "weave/tensor/cuda/device_runtime.h"

using namespace weave;

// Own flags: --backend=nccl (default mpi); --require-cuda exits 77 (CTest's skip code) on every
// rank when no CUDA device is visible.
int main(int argc, char** argv) {
  set_num_threads(1);  // ranks share the machine's cores
  std::vector<char*> args;
  bool require_cuda = false, nccl = false;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--require-cuda")
      require_cuda = true;
    else if (arg == "--backend=nccl")
      nccl = true;
    else
      args.push_back(argv[i]);
  }
  if (require_cuda && !cuda::is_available()) {
    dist::InitGuard guard(dist::Backend::MPI);  // every rank starts and stops MPI cleanly
    if (dist::rank() == 0) std::printf("skipped: no CUDA device (or weave built without CUDA)\n");
    return 77;
  }
  dist::InitGuard guard(nccl ? dist::Backend::NCCL : dist::Backend::MPI);
  const int rank = dist::rank(), size = dist::world_size();

  std::ostringstream report;
  doctest::Context context(static_cast<int>(args.size()), args.data());
  context.setOption("no-version", true);
  context.setOption("no-colors", true);
  // WEAVE_MPI_TEST_LIVE=1 prints each rank's report as it happens (for debugging a hang).
  if (std::getenv("WEAVE_MPI_TEST_LIVE") == nullptr) context.setCout(&report);
  const int failed = context.run() != 0 ? 1 : 0;

  // Collect every rank's verdict and report on rank 0.
  Tensor verdicts = empty({size}, {.dtype = kInt32});
  dist::all_gather(verdicts, full({1}, failed, {.dtype = kInt32}));
  std::string text = report.str();
  std::vector<uint8_t> bytes(text.begin(), text.end());
  Tensor mine = bytes.empty() ? empty({0}, {.dtype = kUInt8}) : from_vector(bytes);
  Tensor all = dist::all_gather_uneven(mine);
  Tensor lengths = empty({size}, {.dtype = kInt64});
  dist::all_gather(lengths, full({1}, static_cast<double>(bytes.size()), {.dtype = kInt64}));
  if (rank == 0) {
    auto verdict = verdicts.to_vector<int32_t>();
    auto length = lengths.to_vector<int64_t>();
    auto chars = all.to_vector<uint8_t>();
    std::vector<int> failing;
    int64_t offset = 0;
    for (int r = 0; r < size; ++r) {
      if (verdict[r] || r == 0)
        std::printf("---- rank %d of %d%s ----\n%.*s", r, size, verdict[r] ? " (FAILED)" : "",
                    static_cast<int>(length[r]),
                    reinterpret_cast<const char*>(chars.data() + offset));
      if (verdict[r]) failing.push_back(r);
      offset += length[r];
    }
    if (failing.empty()) {
      std::printf("mpi tests passed on all %d ranks\n", size);
    } else {
      std::string list;
      for (int r : failing) list += (list.empty() ? "" : ", ") + std::to_string(r);
      std::printf("mpi tests FAILED on rank(s) %s of %d\n", list.c_str(), size);
    }
    std::fflush(stdout);
  }
  int any_failed = 0;
  for (int32_t v : verdicts.to_vector<int32_t>()) any_failed |= v;
  return any_failed;
}

// weave collectives vs raw MPI on the same buffers, same run: sizes 8 B .. 64 MB, alternating
// trials, medians of >= 7 repetitions. Run under mpirun (2+ ranks):
//   mpirun -np 2 bench_collectives [repetitions=7] [op]
// Two lines per case, weave as shipped and weave with its agreement check off (the same calls
// after dist::set_check_mode(Off), timed in the same alternation), each against the same MPI:
// op= check=guard bytes= ranks= weave_us= mpi_us= ratio= busbw_GBps= guard_us=
// op= check=off bytes= ranks= weave_us= mpi_us= ratio=
// (ratio = weave / mpi; busbw as nccl-tests defines it, from weave's time; guard_us = what
// the guard adds per call, guarded minus unguarded median.)
#include <mpi.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench_util.h"
#include "weave/distributed/distributed.h"
#include "weave/ops/ops.h"

using namespace weave;

namespace {

// Seconds per call of fn, timed together on all ranks (rank 0's clock after a barrier).
double per_call(const std::function<void()>& fn, int iterations) {
  MPI_Barrier(MPI_COMM_WORLD);
  double start = MPI_Wtime();
  for (int i = 0; i < iterations; ++i) fn();
  double t = (MPI_Wtime() - start) / iterations;
  MPI_Bcast(&t, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  set_num_threads(1);
  dist::InitGuard guard(dist::Backend::MPI);
  const int n = dist::world_size(), me = dist::rank();
  const int reps = argc > 1 ? std::stoi(argv[1]) : 7;
  const std::string only = argc > 2 ? argv[2] : "";  // e.g. "broadcast": run just that op
  if (n < 2 && me == 0) std::printf("run under mpirun with 2 or more ranks\n");
  std::vector<int64_t> sizes;
  for (int64_t b = 8; b <= (int64_t{64} << 20); b *= 4) sizes.push_back(b);
  sizes.push_back(int64_t{64} << 20);

  struct Case {
    std::string op;
    double bus_factor;  // busbw = algbw * factor
    std::function<std::pair<std::function<void()>, std::function<void()>>(int64_t bytes)> make;
  };
  const double ring = double(n - 1) / n;
  std::vector<Case> cases = {
      {"all_reduce", 2 * ring,
       [&](int64_t bytes) {
         Tensor t = ones({bytes / 4});
         return std::make_pair(std::function<void()>([t] { dist::all_reduce(t); }),
                               std::function<void()>([t] {
                                 MPI_Allreduce(MPI_IN_PLACE, t.data_ptr(), int(t.numel()),
                                               MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
                               }));
       }},
      // Avg = a sum divided by the group size; the peer is MPI's plain sum, so the ratio is
      // what averaging costs on top of the reduction.
      {"all_reduce_avg", 2 * ring,
       [&](int64_t bytes) {
         Tensor t = ones({bytes / 4});
         return std::make_pair(
             std::function<void()>([t] { dist::all_reduce(t, dist::ReduceOp::Avg); }),
             std::function<void()>([t] {
               MPI_Allreduce(MPI_IN_PLACE, t.data_ptr(), int(t.numel()), MPI_FLOAT, MPI_SUM,
                             MPI_COMM_WORLD);
             }));
       }},
      {"broadcast", 1.0,
       [&](int64_t bytes) {
         Tensor t = ones({bytes / 4});
         return std::make_pair(
             std::function<void()>([t] { dist::broadcast(t, 0); }), std::function<void()>([t] {
               MPI_Bcast(t.data_ptr(), int(t.numel()), MPI_FLOAT, 0, MPI_COMM_WORLD);
             }));
       }},
      {"all_gather", ring,
       [&](int64_t bytes) {  // bytes = output size
         int64_t per = std::max<int64_t>(bytes / 4 / n, 1);
         Tensor in = ones({per}), out = empty({per * n});
         return std::make_pair(std::function<void()>([in, out] { dist::all_gather(out, in); }),
                               std::function<void()>([in, out] {
                                 MPI_Allgather(in.data_ptr(), int(in.numel()), MPI_FLOAT,
                                               out.data_ptr(), int(in.numel()), MPI_FLOAT,
                                               MPI_COMM_WORLD);
                               }));
       }},
      {"reduce_scatter", ring,
       [&](int64_t bytes) {  // bytes = input size
         int64_t per = std::max<int64_t>(bytes / 4 / n, 1);
         Tensor in = ones({per * n}), out = empty({per});
         return std::make_pair(std::function<void()>([in, out] { dist::reduce_scatter(out, in); }),
                               std::function<void()>([in, out] {
                                 MPI_Reduce_scatter_block(in.data_ptr(), out.data_ptr(),
                                                          int(out.numel()), MPI_FLOAT, MPI_SUM,
                                                          MPI_COMM_WORLD);
                               }));
       }},
      {"all_to_all", ring,
       [&](int64_t bytes) {
         int64_t per = std::max<int64_t>(bytes / 4 / n, 1);
         Tensor in = ones({per * n}), out = empty({per * n});
         return std::make_pair(std::function<void()>([in, out] { dist::all_to_all(out, in); }),
                               std::function<void()>([in, out, per] {
                                 MPI_Alltoall(in.data_ptr(), int(per), MPI_FLOAT, out.data_ptr(),
                                              int(per), MPI_FLOAT, MPI_COMM_WORLD);
                               }));
       }},
      {"send_recv", 1.0,
       [&](int64_t bytes) {  // ping-pong between ranks 0 and 1; time per one-way message
         Tensor t = ones({bytes / 4});
         auto weave_fn = [t, me] {
           if (me == 0) {
             dist::send(t, 1);
             dist::recv(t, 1);
           } else if (me == 1) {
             dist::recv(t, 0);
             dist::send(t, 0);
           }
         };
         auto mpi_fn = [t, me] {
           if (me == 0) {
             MPI_Send(t.data_ptr(), int(t.numel()), MPI_FLOAT, 1, 0, MPI_COMM_WORLD);
             MPI_Recv(t.data_ptr(), int(t.numel()), MPI_FLOAT, 1, 0, MPI_COMM_WORLD,
                      MPI_STATUS_IGNORE);
           } else if (me == 1) {
             MPI_Recv(t.data_ptr(), int(t.numel()), MPI_FLOAT, 0, 0, MPI_COMM_WORLD,
                      MPI_STATUS_IGNORE);
             MPI_Send(t.data_ptr(), int(t.numel()), MPI_FLOAT, 0, 0, MPI_COMM_WORLD);
           }
         };
         return std::make_pair(std::function<void()>(weave_fn), std::function<void()>(mpi_fn));
       }},
  };

  for (const Case& c : cases) {
    if (!only.empty() && c.op != only) continue;
    for (int64_t bytes : sizes) {
      auto [weave_fn, mpi_fn] = c.make(bytes);
      // About 32 MB moved per timing (at least 16 ms at 2 MB): shorter timings of the large
      // sizes wandered by 5-10% between repetitions on the 2-core machine.
      const int iterations = int(std::clamp<int64_t>((int64_t{32} << 20) / bytes, 1, 2000));
      weave_fn();
      mpi_fn();
      // Three contenders, each repetition starting with another: weave as shipped (the
      // guard), weave with the guard off (set_check_mode on every rank, outside the timing),
      // raw MPI.
      std::vector<double> times[3];
      for (int r = 0; r < reps; ++r)
        for (int k = 0; k < 3; ++k) {
          const int who = (r + k) % 3;
          if (who < 2)
            dist::set_check_mode(who == 0 ? dist::CheckMode::Guard : dist::CheckMode::Off);
          times[who].push_back(per_call(who < 2 ? weave_fn : mpi_fn, iterations));
        }
      dist::set_check_mode(dist::CheckMode::Guard);
      const double per_message = c.op == "send_recv" ? 0.5 : 1.0;  // a ping-pong is two
      const double guarded = bench::median(times[0]) * per_message,
                   unguarded = bench::median(times[1]) * per_message,
                   mpi = bench::median(times[2]) * per_message;
      if (me == 0) {
        std::printf(
            "op=%s check=guard bytes=%ld ranks=%d weave_us=%.2f mpi_us=%.2f ratio=%.3f "
            "busbw_GBps=%.3f guard_us=%.2f\n",
            c.op.c_str(), long(bytes), n, guarded * 1e6, mpi * 1e6, guarded / mpi,
            double(bytes) / guarded * c.bus_factor * 1e-9, (guarded - unguarded) * 1e6);
        std::printf("op=%s check=off bytes=%ld ranks=%d weave_us=%.2f mpi_us=%.2f ratio=%.3f\n",
                    c.op.c_str(), long(bytes), n, unguarded * 1e6, mpi * 1e6, unguarded / mpi);
      }
    }
  }
  std::fflush(stdout);
}

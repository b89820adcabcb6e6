// Collectives on CUDA tensors: under NCCL (device memory end to end) and under MPI (staged
// through the host). Run only with --require-cuda, which skips them without a GPU.
#include <doctest/doctest.h>

#include "weave/distributed/distributed.h"
#include "weave/weave.h"

using namespace weave;
using dist::ReduceOp;

namespace {
Tensor value(const Shape& shape, DType dtype, int r, Device device) {
  std::vector<double> v(shape.numel());
  for (size_t i = 0; i < v.size(); ++i) v[i] = double((int64_t(i) + r * 7) % 5 + 1);
  return from_vector(v, Shape{int64_t(v.size())}).reshape(shape).to(dtype).to(device);
}
Device gpu() {
  return dist::backend() == dist::Backend::NCCL ? dist::device() : Device::cuda(0);
}
}  // namespace

TEST_SUITE("cuda_collectives") {
  TEST_CASE("collectives on CUDA tensors match the host results") {
    const int n = dist::world_size(), me = dist::rank();
    for (DType dtype : {kFloat32, kFloat64, kBFloat16, kInt64}) {
      for (Shape shape : {Shape{7}, Shape{33, 5}}) {
        Tensor expected = value(shape, kFloat64, 0, kCPU) * 0.0;
        for (int r = 0; r < n; ++r) expected = expected + value(shape, kFloat64, r, kCPU);

        Tensor t = value(shape, dtype, me, gpu());
        dist::all_reduce(t);
        CHECK(t.device() == gpu());
        CHECK(allclose(t.cpu().to(kFloat64), expected, 1e-2));

        Tensor b = value(shape, dtype, me, gpu());
        dist::broadcast(b, n - 1);
        CHECK(allclose(b.cpu().to(kFloat64), value(shape, kFloat64, n - 1, kCPU)));

        Shape stacked = shape;
        stacked[0] *= n;
        Tensor gathered = empty(stacked, {.dtype = dtype, .device = gpu()});
        dist::all_gather(gathered, value(shape, dtype, me, gpu()));
        for (int r = 0; r < n; ++r)
          CHECK(allclose(gathered.narrow(0, r * shape[0], shape[0]).cpu().to(kFloat64),
                         value(shape, kFloat64, r, kCPU)));

        Tensor piece = empty(shape, {.dtype = dtype, .device = gpu()});
        dist::reduce_scatter(piece, value(stacked, dtype, me, gpu()));
        Tensor sum = value(stacked, kFloat64, 0, kCPU) * 0.0;
        for (int r = 0; r < n; ++r) sum = sum + value(stacked, kFloat64, r, kCPU);
        CHECK(allclose(piece.cpu().to(kFloat64), sum.narrow(0, me * shape[0], shape[0]), 1e-2));

        Tensor exchanged = empty(stacked, {.dtype = dtype, .device = gpu()});
        dist::all_to_all(exchanged, value(stacked, dtype, me, gpu()));
        for (int r = 0; r < n; ++r)
          CHECK(allclose(exchanged.narrow(0, r * shape[0], shape[0]).cpu().to(kFloat64),
                         value(stacked, kFloat64, r, kCPU).narrow(0, me * shape[0], shape[0])));
      }
    }
    Tensor avg = full({4}, double(me + 1), {.device = gpu()});
    dist::all_reduce(avg, ReduceOp::Avg);
    CHECK(allclose(avg.cpu(), full({4}, (n + 1) / 2.0)));
    if (n >= 2) {
      Tensor t = value({6}, kFloat32, me, gpu()), in = empty({6}, {.device = gpu()});
      auto s = dist::send(t, (me + 1) % n, dist::world(), 0, true);
      dist::recv(in, (me + n - 1) % n);
      s.wait();
      CHECK(allclose(in.cpu(), value({6}, kFloat32, (me + n - 1) % n, kCPU)));
    }
    // Receivers with no input of their own allocate on the sender's device type, so both ends
    // take the same route (under NCCL: NCCL for CUDA, MPI for CPU) and nothing hangs.
    namespace F = dist::functional;
    for (bool cuda_root : {false, true}) {
      CAPTURE(cuda_root);
      const Device root_device = cuda_root ? gpu() : kCPU;
      Tensor source = me == 0 ? value({5}, kFloat32, 0, root_device) : Tensor();
      Tensor b = F::broadcast(source, 0);
      CHECK(b.device().type == root_device.type);
      CHECK(allclose(b.cpu(), value({5}, kFloat32, 0, kCPU)));
      Tensor whole = me == 0 ? value({2 * n, 3}, kFloat32, 0, root_device) : Tensor();
      Tensor piece = F::scatter(whole, 0, 0);
      CHECK(piece.device().type == root_device.type);
      CHECK(allclose(piece.cpu(), value({2 * n, 3}, kFloat32, 0, kCPU).narrow(0, 2 * me, 2)));
      if (n >= 2) {
        if (me == 0) F::remote_send(value({4}, kFloat32, 0, root_device), 1);
        if (me == 1) {
          Tensor got = F::remote_recv(0);
          CHECK(got.device().type == root_device.type);
          CHECK(allclose(got.cpu(), value({4}, kFloat32, 0, kCPU)));
        }
      }
    }
    // A CPU tensor under NCCL travels over the group's MPI communicator.
    Tensor host = full({3}, 1.0);
    dist::all_reduce(host);
    CHECK(host.to_vector<float>() == std::vector<float>(3, float(n)));
  }
}

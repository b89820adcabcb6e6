// The NCCL backend: CUDA buffers, one NCCL communicator per group on its own stream. Work is
// ordered after weave's compute stream (an event), and each call waits for its stream by
// polling, so a hang stays visible to the watchdog and NCCL's async errors are reported.
#include <cuda_runtime.h>
#include <nccl.h>

#include <thread>

#include "weave/distributed/communicator.h"
#include "weave/tensor/cuda/calls.h"
#include "weave/tensor/cuda/device_runtime.h"

namespace weave::detail {
// ncclInProgress: a non-blocking communicator accepted the call; completion is polled for.
inline bool call_succeeded(ncclResult_t status) {
  return status == ncclSuccess || status == ncclInProgress;
}
inline std::string call_error(ncclResult_t status) {
  const char* last = ncclGetLastError(nullptr);
  return fmt::format("{} (NCCL){}{}", ncclGetErrorString(status), last && *last ? ": " : "",
                     last ? last : "");
}
}  // namespace weave::detail

namespace weave::dist::detail {

namespace {

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case kFloat32:
      return ncclFloat32;
    case kFloat64:
      return ncclFloat64;
    case kFloat16:
      return ncclFloat16;
    case kBFloat16:
      return ncclBfloat16;
    case kInt32:
      return ncclInt32;
    case kInt64:
      return ncclInt64;
    case kUInt8:
    case kBool:
      return ncclUint8;
  }
  WEAVE_FAIL("nccl", "unsupported dtype {}", dtype);
}

ncclRedOp_t nccl_op(ReduceOp op, DType dtype) {
  if (dtype == kBool)
    return (op == ReduceOp::Sum || op == ReduceOp::Max) ? ncclMax : ncclMin;  // any / all
  switch (op) {
    case ReduceOp::Sum:
      return ncclSum;
    case ReduceOp::Prod:
      return ncclProd;
    case ReduceOp::Min:
      return ncclMin;
    case ReduceOp::Max:
      return ncclMax;
    case ReduceOp::Avg:
      return ncclAvg;
  }
  return ncclSum;
}

size_t bytes_of(int64_t count, DType dtype) {
  return static_cast<size_t>(count) * itemsize(dtype);
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int device) : comm_(comm), device_(device) {
    cuda::DeviceGuard guard(device_);
    WEAVE_CHECK_CALL(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "nccl");
    WEAVE_CHECK_CALL(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "nccl");
    WEAVE_CHECK_CALL(ncclCommCount(comm_, &size_), "nccl");
    WEAVE_CHECK_CALL(ncclCommUserRank(comm_, &rank_), "nccl");
  }
  ~NcclCommunicator() override {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    ncclCommDestroy(comm_);
    cudaEventDestroy(ready_);
    cudaStreamDestroy(stream_);
    cudaSetDevice(previous);
  }
  int size() const override { return size_; }
  int rank() const override { return rank_; }

  bool all_reduce_mean(const void* in, void* out, int64_t n, DType t) override {
    run("all_reduce", [&] {  // ncclAvg folds the division into the reduction kernel
      return ncclAllReduce(in, out, size_t(n), nccl_type(t), ncclAvg, comm_, stream_);
    });
    return true;
  }
  void all_reduce(const void* in, void* out, int64_t n, DType t, ReduceOp op) override {
    run("all_reduce", [&] {
      return ncclAllReduce(in, out, size_t(n), nccl_type(t), nccl_op(op, t), comm_, stream_);
    });
  }
  void broadcast(void* buffer, int64_t n, DType t, int root) override {
    run("broadcast", [&] {
      return ncclBroadcast(buffer, buffer, size_t(n), nccl_type(t), root, comm_, stream_);
    });
  }
  void reduce(const void* in, void* out, int64_t n, DType t, ReduceOp op, int root) override {
    run("reduce", [&] {
      return ncclReduce(in, out, size_t(n), nccl_type(t), nccl_op(op, t), root, comm_, stream_);
    });
  }
  void all_gather(const void* in, void* out, int64_t n, DType t) override {
    run("all_gather",
        [&] { return ncclAllGather(in, out, size_t(n), nccl_type(t), comm_, stream_); });
  }
  void all_gather_v(const void* in, void* out, const std::vector<int64_t>& counts,
                    DType t) override {
    run("all_gather_uneven", [&] {  // one broadcast per rank, fused
      const ncclResult_t started = ncclGroupStart();
      if (started != ncclSuccess) return started;
      size_t offset = 0;
      for (int r = 0; r < size_; ++r) {
        char* dst = static_cast<char*>(out) + bytes_of(int64_t(offset), t);
        ncclResult_t result = ncclBroadcast(r == rank_ ? in : dst, dst, size_t(counts[r]),
                                            nccl_type(t), r, comm_, stream_);
        if (result != ncclSuccess) {
          ncclGroupEnd();
          return result;
        }
        offset += size_t(counts[r]);
      }
      return ncclGroupEnd();
    });
  }
  void reduce_scatter(const void* in, void* out, int64_t n, DType t, ReduceOp op) override {
    run("reduce_scatter", [&] {
      return ncclReduceScatter(in, out, size_t(n), nccl_type(t), nccl_op(op, t), comm_, stream_);
    });
  }
  void gather(const void* in, void* out, int64_t n, DType t, int root) override {
    std::vector<int64_t> none(size_, 0), from_all(size_, n);
    std::vector<int64_t> to_root(size_, 0);
    to_root[root] = n;
    exchange("gather", in, to_root, out, rank_ == root ? from_all : none, t);
  }
  void scatter(const void* in, void* out, int64_t n, DType t, int root) override {
    std::vector<int64_t> none(size_, 0), to_all(size_, n);
    std::vector<int64_t> from_root(size_, 0);
    from_root[root] = n;
    exchange("scatter", in, rank_ == root ? to_all : none, out, from_root, t);
  }
  void all_to_all(const void* in, void* out, int64_t n, DType t) override {
    std::vector<int64_t> counts(size_, n);
    exchange("all_to_all", in, counts, out, counts, t);
  }
  void all_to_all_v(const void* in, const std::vector<int64_t>& send_counts, void* out,
                    const std::vector<int64_t>& recv_counts, DType t) override {
    exchange("all_to_all", in, send_counts, out, recv_counts, t);
  }
  void send(const void* buffer, int64_t n, DType t, int dst, int) override {
    run("send", [&] { return ncclSend(buffer, size_t(n), nccl_type(t), dst, comm_, stream_); });
  }
  void recv(void* buffer, int64_t n, DType t, int src, int) override {
    run("recv", [&] { return ncclRecv(buffer, size_t(n), nccl_type(t), src, comm_, stream_); });
  }
  void exchange(const std::vector<Part>& parts, int) override {
    run("exchange", [&] {
      const ncclResult_t started = ncclGroupStart();
      if (started != ncclSuccess) return started;
      ncclResult_t result = ncclSuccess;
      for (const Part& part : parts) {
        result =
            part.send
                ? ncclSend(part.bytes, size_t(part.size), ncclUint8, part.peer, comm_, stream_)
                : ncclRecv(part.bytes, size_t(part.size), ncclUint8, part.peer, comm_, stream_);
        if (result != ncclSuccess) break;
      }
      const ncclResult_t ended = ncclGroupEnd();
      return result != ncclSuccess ? result : ended;
    });
  }
  void barrier() override {
    void* scratch = cuda::allocate(sizeof(float), device_);
    run("barrier",
        [&] { return ncclAllReduce(scratch, scratch, 1, ncclFloat32, ncclSum, comm_, stream_); });
    cuda::deallocate(scratch, sizeof(float), device_);
  }
  std::unique_ptr<Communicator> split(const std::vector<int>& members) override {
    int color = NCCL_SPLIT_NOCOLOR, key = 0;
    for (size_t i = 0; i < members.size(); ++i)
      if (members[i] == rank_) {
        color = 0;
        key = int(i);
      }
    ncclComm_t comm = nullptr;
    cuda::DeviceGuard guard(device_);
    WEAVE_CHECK_CALL(ncclCommSplit(comm_, color, key, &comm, nullptr), "new_group");
    if (comm == nullptr) return nullptr;
    return std::make_unique<NcclCommunicator>(comm, device_);
  }

 private:
  // Orders the NCCL stream after weave's compute stream, enqueues, then waits for completion.
  template <class Enqueue>
  void run(const char* op, Enqueue&& enqueue) {
    cuda::DeviceGuard guard(device_);  // the caller's device is current again on return
    WEAVE_CHECK_CALL(
        cudaEventRecord(ready_, static_cast<cudaStream_t>(cuda::stream_handle(device_))), op);
    WEAVE_CHECK_CALL(cudaStreamWaitEvent(stream_, ready_, 0), op);
    WEAVE_CHECK_CALL(enqueue(), op);
    for (;;) {
      cudaError_t state = cudaStreamQuery(stream_);
      if (state == cudaSuccess) break;
      if (state != cudaErrorNotReady) WEAVE_CHECK_CALL(state, op);
      ncclResult_t async = ncclSuccess;
      WEAVE_CHECK_CALL(ncclCommGetAsyncError(comm_, &async), op);
      WEAVE_CHECK_CALL(async, op);
      std::this_thread::yield();
    }
    // Consumers of the result run on weave's stream, which must see the NCCL writes.
    WEAVE_CHECK_CALL(cudaEventRecord(ready_, stream_), op);
    WEAVE_CHECK_CALL(
        cudaStreamWaitEvent(static_cast<cudaStream_t>(cuda::stream_handle(device_)), ready_, 0),
        op);
  }

  // Point-to-point exchange of counts[j] elements with every rank j (fused).
  void exchange(const char* op, const void* in, const std::vector<int64_t>& send_counts, void* out,
                const std::vector<int64_t>& recv_counts, DType t) {
    run(op, [&] {
      // Every call between GroupStart and GroupEnd is checked; the group is always closed
      // before a failure is reported.
      ncclResult_t result = ncclGroupStart();
      if (result != ncclSuccess) return result;
      cudaError_t copy = cudaSuccess;
      size_t sent = 0, received = 0;
      for (int j = 0; j < size_ && result == ncclSuccess && copy == cudaSuccess; ++j) {
        if (send_counts[j] > 0) {
          const char* src = static_cast<const char*>(in) + bytes_of(int64_t(sent), t);
          if (j == rank_) {
            char* dst =
                static_cast<char*>(out) + bytes_of(int64_t(received_offset(recv_counts, j)), t);
            copy = cudaMemcpyAsync(dst, src, bytes_of(send_counts[j], t), cudaMemcpyDeviceToDevice,
                                   stream_);
          } else {
            result = ncclSend(src, size_t(send_counts[j]), nccl_type(t), j, comm_, stream_);
          }
        }
        if (result == ncclSuccess && recv_counts[j] > 0 && j != rank_) {
          char* dst = static_cast<char*>(out) + bytes_of(int64_t(received), t);
          result = ncclRecv(dst, size_t(recv_counts[j]), nccl_type(t), j, comm_, stream_);
        }
        sent += size_t(send_counts[j]);
        received += size_t(recv_counts[j]);
      }
      const ncclResult_t ended = ncclGroupEnd();
      WEAVE_CHECK_CALL(copy, op);
      return result != ncclSuccess ? result : ended;
    });
  }
  static size_t received_offset(const std::vector<int64_t>& counts, int upto) {
    size_t offset = 0;
    for (int j = 0; j < upto; ++j) offset += size_t(counts[j]);
    return offset;
  }

  ncclComm_t comm_;
  int device_;
  int size_ = 1, rank_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;
};

}  // namespace

namespace nccl {

bool available() {
  return true;
}

std::unique_ptr<Communicator> init_world(Communicator& host_world, int device) {
  ncclUniqueId id;
  if (host_world.rank() == 0) WEAVE_CHECK_CALL(ncclGetUniqueId(&id), "init");
  host_world.broadcast(&id, sizeof(id), kUInt8, 0);
  cuda::DeviceGuard guard(device);
  ncclComm_t comm = nullptr;
  WEAVE_CHECK_CALL(ncclCommInitRank(&comm, host_world.size(), id, host_world.rank()), "init");
  return std::make_unique<NcclCommunicator>(comm, device);
}

}  // namespace nccl

}  // namespace weave::dist::detail

// The backend of a world of one process, for programs not started by mpirun.
#include <cstring>

#include "weave/distributed/communicator.h"
#include "weave/tensor/error.h"

namespace weave::dist::detail {

namespace {

class LocalCommunicator final : public Communicator {
 public:
  int size() const override { return 1; }
  int rank() const override { return 0; }
  void all_reduce(const void* in, void* out, int64_t n, DType t, ReduceOp) override {
    move(in, out, n, t);
  }
  void broadcast(void*, int64_t, DType, int) override {}
  void reduce(const void* in, void* out, int64_t n, DType t, ReduceOp, int) override {
    move(in, out, n, t);
  }
  void all_gather(const void* in, void* out, int64_t n, DType t) override { move(in, out, n, t); }
  void all_gather_v(const void* in, void* out, const std::vector<int64_t>& counts,
                    DType t) override {
    move(in, out, counts[0], t);
  }
  void reduce_scatter(const void* in, void* out, int64_t n, DType t, ReduceOp) override {
    move(in, out, n, t);
  }
  void gather(const void* in, void* out, int64_t n, DType t, int) override { move(in, out, n, t); }
  void scatter(const void* in, void* out, int64_t n, DType t, int) override { move(in, out, n, t); }
  void all_to_all(const void* in, void* out, int64_t n, DType t) override { move(in, out, n, t); }
  void all_to_all_v(const void* in, const std::vector<int64_t>& counts, void* out,
                    const std::vector<int64_t>&, DType t) override {
    move(in, out, counts[0], t);
  }
  void send(const void*, int64_t, DType, int, int) override {
    WEAVE_FAIL("send", "a world of one process has no peer to send to");
  }
  void recv(void*, int64_t, DType, int, int) override {
    WEAVE_FAIL("recv", "a world of one process has no peer to receive from");
  }
  void exchange(const std::vector<Part>&, int) override {
    WEAVE_FAIL("exchange", "a world of one process has no peer to exchange with");
  }
  void barrier() override {}
  std::unique_ptr<Communicator> split(const std::vector<int>&) override {
    return std::make_unique<LocalCommunicator>();
  }

 private:
  static void move(const void* in, void* out, int64_t n, DType t) {
    if (in != out) std::memmove(out, in, static_cast<size_t>(n) * itemsize(t));
  }
};

}  // namespace

std::unique_ptr<Communicator> make_local_communicator() {
  return std::make_unique<LocalCommunicator>();
}

}  // namespace weave::dist::detail

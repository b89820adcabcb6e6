// The MPI backend: one duplicated communicator per group, MPI_THREAD_MULTIPLE (each group's
// queue may call MPI from its own thread), errors returned rather than fatal.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>

#include "weave/distributed/communicator.h"
#include "weave/distributed/mpi/chunks.h"
#include "weave/distributed/mpi/mpi_types.h"
#include "weave/tensor/process_memory.h"

namespace weave::dist::detail {

namespace {

// WEAVE_MPI_SEND=synchronous: a send alone returns only once its receive is posted (MPI_Ssend),
// as NCCL's ungrouped send does, so that CPU tests catch the orders that would deadlock there.
bool synchronous_sends = false;
// WEAVE_MPI_CHUNK_MB: reduce-scatters and all-gathers of more bytes over all ranks go in chunks
// of that size (chunks.h); 0: whole.
int64_t chunk_bytes = int64_t{16} << 20;

int as_int(int64_t n, const char* op) {
  WEAVE_CHECK(n >= 0 && n <= 0x7fffffff, op, "count {} does not fit MPI's int", n);
  return static_cast<int>(n);
}

// MPI wants int counts and displacements.
struct Counts {
  std::vector<int> counts, displacements;
  Counts(const std::vector<int64_t>& c, const char* op) {
    int64_t offset = 0;
    for (int64_t n : c) {
      counts.push_back(as_int(n, op));
      displacements.push_back(as_int(offset, op));
      offset += n;
    }
  }
};

class MpiPendingSend final : public PendingSend {
 public:
  explicit MpiPendingSend(MPI_Request request) : request_(request) {}
  ~MpiPendingSend() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    // abandoned (teardown after an error): MPI still completes it, nobody waits for it
    if (!finalized && request_ != MPI_REQUEST_NULL) MPI_Request_free(&request_);
  }
  bool done() override {
    int flag = 0;
    WEAVE_CHECK_CALL(MPI_Test(&request_, &flag, MPI_STATUS_IGNORE), "send");
    return flag != 0;
  }

 private:
  MPI_Request request_;
};

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm) : comm_(comm) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }
  int size() const override { return size_; }
  int rank() const override { return rank_; }

  void all_reduce(const void* in, void* out, int64_t n, DType t, ReduceOp op) override {
    all_reduce_in_pieces(in, out, n, t, mpi_op(op, t));
  }
  bool all_reduce_mean(const void* in, void* out, int64_t n, DType t) override {
    if (size_ != 2 || !is_floating(t)) return false;
    all_reduce_in_pieces(in, out, n, t, mean_of_two_op());
    return true;
  }
  void broadcast(void* buffer, int64_t n, DType t, int root) override {
    WEAVE_CHECK_CALL(MPI_Bcast(buffer, as_int(n, "broadcast"), mpi_type(t), root, comm_),
                     "broadcast");
  }
  void reduce(const void* in, void* out, int64_t n, DType t, ReduceOp op, int root) override {
    const void* send = (in == out && rank_ == root) ? MPI_IN_PLACE : in;
    WEAVE_CHECK_CALL(
        MPI_Reduce(send, out, as_int(n, "reduce"), mpi_type(t), mpi_op(op, t), root, comm_),
        "reduce");
  }
  void all_gather(const void* in, void* out, int64_t n, DType t) override {
    const int64_t item = int64_t(itemsize(t)), chunk = chunk_elements(chunk_bytes, size_, item);
    if (chunk > 0 && n > chunk) {  // in pieces, each gathered packed (chunks.h)
      all_gather_in_chunks(
          static_cast<const char*>(in), static_cast<char*>(out), n, size_, item, chunk,
          [&](const char* send, char* recv, int64_t m) { all_gather(send, recv, m, t); });
      return;
    }
    const int count = as_int(n, "all_gather");
    // In place when the input is this rank's own slice of the output (as NCCL allows too).
    const void* own = static_cast<const char*>(out) + int64_t(rank_) * n * item;
    const void* send = in == own ? MPI_IN_PLACE : in;
    WEAVE_CHECK_CALL(MPI_Allgather(send, count, mpi_type(t), out, count, mpi_type(t), comm_),
                     "all_gather");
  }
  void all_gather_v(const void* in, void* out, const std::vector<int64_t>& counts,
                    DType t) override {
    Counts c(counts, "all_gather_uneven");
    WEAVE_CHECK_CALL(MPI_Allgatherv(in, c.counts[rank_], mpi_type(t), out, c.counts.data(),
                                    c.displacements.data(), mpi_type(t), comm_),
                     "all_gather_uneven");
  }
  void reduce_scatter(const void* in, void* out, int64_t n, DType t, ReduceOp op) override {
    const int64_t chunk = chunk_elements(chunk_bytes, size_, int64_t(itemsize(t)));
    reduce_scatter_in_chunks(
        static_cast<const char*>(in), static_cast<char*>(out), n, size_, int64_t(itemsize(t)),
        chunk, [&](const char* send, char* recv, int64_t m) {
          WEAVE_CHECK_CALL(MPI_Reduce_scatter_block(send, recv, as_int(m, "reduce_scatter"),
                                                    mpi_type(t), mpi_op(op, t), comm_),
                           "reduce_scatter");
        });
  }
  void gather(const void* in, void* out, int64_t n, DType t, int root) override {
    const int count = as_int(n, "gather");
    WEAVE_CHECK_CALL(MPI_Gather(in, count, mpi_type(t), out, count, mpi_type(t), root, comm_),
                     "gather");
  }
  void scatter(const void* in, void* out, int64_t n, DType t, int root) override {
    const int count = as_int(n, "scatter");
    WEAVE_CHECK_CALL(MPI_Scatter(in, count, mpi_type(t), out, count, mpi_type(t), root, comm_),
                     "scatter");
  }
  void all_to_all(const void* in, void* out, int64_t n, DType t) override {
    const int count = as_int(n, "all_to_all");
    WEAVE_CHECK_CALL(MPI_Alltoall(in, count, mpi_type(t), out, count, mpi_type(t), comm_),
                     "all_to_all");
  }
  void all_to_all_v(const void* in, const std::vector<int64_t>& send_counts, void* out,
                    const std::vector<int64_t>& recv_counts, DType t) override {
    Counts s(send_counts, "all_to_all"), r(recv_counts, "all_to_all");
    WEAVE_CHECK_CALL(MPI_Alltoallv(in, s.counts.data(), s.displacements.data(), mpi_type(t), out,
                                   r.counts.data(), r.displacements.data(), mpi_type(t), comm_),
                     "all_to_all");
  }
  void send(const void* buffer, int64_t n, DType t, int dst, int tag) override {
    if (synchronous_sends)
      WEAVE_CHECK_CALL(MPI_Ssend(buffer, as_int(n, "send"), mpi_type(t), dst, tag, comm_), "send");
    else
      WEAVE_CHECK_CALL(MPI_Send(buffer, as_int(n, "send"), mpi_type(t), dst, tag, comm_), "send");
  }
  void exchange(const std::vector<Part>& parts, int tag) override {
    std::vector<MPI_Request> requests(parts.size(), MPI_REQUEST_NULL);
    for (size_t i = 0; i < parts.size(); ++i) {
      const Part& part = parts[i];
      const int n = as_int(part.size, "exchange");
      if (!part.send)
        WEAVE_CHECK_CALL(MPI_Irecv(part.bytes, n, MPI_BYTE, part.peer, tag, comm_, &requests[i]),
                         "exchange");
      else if (synchronous_sends)
        WEAVE_CHECK_CALL(MPI_Issend(part.bytes, n, MPI_BYTE, part.peer, tag, comm_, &requests[i]),
                         "exchange");
      else
        WEAVE_CHECK_CALL(MPI_Isend(part.bytes, n, MPI_BYTE, part.peer, tag, comm_, &requests[i]),
                         "exchange");
    }
    WEAVE_CHECK_CALL(
        MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE),
        "exchange");
  }
  void recv(void* buffer, int64_t n, DType t, int src, int tag) override {
    WEAVE_CHECK_CALL(
        MPI_Recv(buffer, as_int(n, "recv"), mpi_type(t), src, tag, comm_, MPI_STATUS_IGNORE),
        "recv");
  }
  std::unique_ptr<PendingSend> start_send(const void* buffer, int64_t n, DType t, int dst,
                                          int tag) override {
    if (synchronous_sends) {  // as NCCL's ungrouped send: returns once it is matched
      send(buffer, n, t, dst, tag);
      return nullptr;
    }
    MPI_Request request = MPI_REQUEST_NULL;
    WEAVE_CHECK_CALL(MPI_Isend(buffer, as_int(n, "send"), mpi_type(t), dst, tag, comm_, &request),
                     "send");
    return std::make_unique<MpiPendingSend>(request);
  }
  void barrier() override { WEAVE_CHECK_CALL(MPI_Barrier(comm_), "barrier"); }
  std::unique_ptr<Communicator> split(const std::vector<int>& members) override {
    int color = MPI_UNDEFINED, key = 0;
    for (size_t i = 0; i < members.size(); ++i)
      if (members[i] == rank_) {
        color = 0;
        key = static_cast<int>(i);  // the new communicator follows the group's order
      }
    MPI_Comm comm = MPI_COMM_NULL;
    WEAVE_CHECK_CALL(MPI_Comm_split(comm_, color, key, &comm), "new_group");
    if (comm == MPI_COMM_NULL) return nullptr;
    return std::make_unique<MpiCommunicator>(comm);
  }

 private:
  // Open MPI's all_reduce slows down 2-3x per byte past ~8 MB (measured at 2 and 4 ranks over
  // shared memory: 36 MB whole 15.7 ms, in 4 MB pieces 6.8 ms), so large buffers go in
  // pieces; the pieces also lift MPI's int count limit.
  static constexpr int64_t kPieceBytes = int64_t{4} << 20;

  void all_reduce_in_pieces(const void* in, void* out, int64_t n, DType t, MPI_Op op) {
    const int64_t item = int64_t(itemsize(t));
    const int64_t piece = std::max<int64_t>(1, kPieceBytes / item);
    int64_t start = 0;
    do {  // once even for n == 0: every rank still takes part
      const int64_t count = std::min(piece, n - start);
      void* dst = static_cast<char*>(out) + start * item;
      const void* src = in == out ? MPI_IN_PLACE : static_cast<const char*>(in) + start * item;
      WEAVE_CHECK_CALL(MPI_Allreduce(src, dst, int(count), mpi_type(t), op, comm_), "all_reduce");
      start += piece;
    } while (start < n);
  }
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
};

bool we_initialized = false;
int local = 0, local_ranks = 1;
MPI_Comm control = MPI_COMM_NULL;  // the world again, for finalize's farewell barrier only

}  // namespace

namespace mpi {

bool launched() {
  for (const char* name :
       {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"})
    if (std::getenv(name) != nullptr) return true;
  int initialized = 0;
  MPI_Initialized(&initialized);
  return initialized != 0;
}

std::unique_ptr<Communicator> init_world() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  WEAVE_CHECK(!finalized, "init", "MPI was already finalized in this process; it cannot restart");
  if (!initialized) {
    int provided = 0;
    WEAVE_CHECK_CALL(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "init");
    we_initialized = true;
    WEAVE_CHECK(provided >= MPI_THREAD_MULTIPLE, "init",
                "the MPI library provides thread level {}, weave needs MPI_THREAD_MULTIPLE ({})",
                provided, int(MPI_THREAD_MULTIPLE));
  }
  create_16bit_types();
  const char* sends = std::getenv("WEAVE_MPI_SEND");
  const std::string send_mode = sends != nullptr ? sends : "";
  WEAVE_CHECK(send_mode.empty() || send_mode == "buffered" || send_mode == "synchronous", "init",
              "WEAVE_MPI_SEND='{}' is not a send mode; hint: buffered (the default) or "
              "synchronous (as NCCL's sends: for tests)",
              send_mode);
  synchronous_sends = send_mode == "synchronous";
  if (const char* chunk_mb = std::getenv("WEAVE_MPI_CHUNK_MB")) {
    char* end = nullptr;
    const double mb = std::strtod(chunk_mb, &end);
    WEAVE_CHECK(end != chunk_mb && *end == '\0' && mb >= 0, "init",
                "WEAVE_MPI_CHUNK_MB='{}' is not a size in MB; hint: e.g. 16 (the default), or 0 "
                "to send reduce-scatters and all-gathers whole",
                chunk_mb);
    chunk_bytes = int64_t(mb * double(1 << 20));
  }
  MPI_Comm world = MPI_COMM_NULL, node = MPI_COMM_NULL;
  WEAVE_CHECK_CALL(MPI_Comm_dup(MPI_COMM_WORLD, &world), "init");
  WEAVE_CHECK_CALL(MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node),
                   "init");
  MPI_Comm_rank(node, &local);
  MPI_Comm_size(node, &local_ranks);
  MPI_Comm_free(&node);
  if (control == MPI_COMM_NULL) WEAVE_CHECK_CALL(MPI_Comm_dup(MPI_COMM_WORLD, &control), "init");
  return std::make_unique<MpiCommunicator>(world);
}

int local_rank() {
  return local;
}

bool cores_shared() {
  // Open MPI sets these for a job it runs oversubscribed (and yields in its own waits then).
  for (const char* flag : {"OMPI_MCA_mpi_yield_when_idle", "OMPI_MCA_mpi_oversubscribe"}) {
    const char* v = std::getenv(flag);
    if (v != nullptr && (std::strcmp(v, "1") == 0 || std::strcmp(v, "true") == 0)) return true;
  }
  return local_ranks > int(std::max(1u, std::thread::hardware_concurrency()));
}

// Tags on the control communicator (only farewell's barrier and these messages use it).
constexpr int kLeavingTag = 1;
constexpr int kWaitingTag = 2;

bool farewell(int64_t timeout_ns, std::string* waiting) {
  if (control == MPI_COMM_NULL) return true;
  MPI_Request request = MPI_REQUEST_NULL;
  if (MPI_Ibarrier(control, &request) != MPI_SUCCESS) return false;
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    int done = 0;
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (done) return true;
    int arrived = 0;
    MPI_Status status;
    MPI_Iprobe(MPI_ANY_SOURCE, kWaitingTag, control, &arrived, &status);
    if (arrived) {
      int length = 0;
      MPI_Get_count(&status, MPI_CHAR, &length);
      waiting->assign(static_cast<size_t>(length), '\0');
      MPI_Recv(waiting->data(), length, MPI_CHAR, status.MPI_SOURCE, kWaitingTag, control,
               MPI_STATUS_IGNORE);
      return false;
    }
    if (std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                             start)
            .count() > timeout_ns)
      return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

namespace {
std::vector<int64_t> leaving_notice;  // kept alive until its sends complete
std::vector<MPI_Request> leaving_sends;

std::vector<int64_t> receive_notice(const MPI_Status& status) {
  int count = 0;
  MPI_Get_count(&status, MPI_INT64_T, &count);
  std::vector<int64_t> notice(static_cast<size_t>(std::max(count, 0)));
  MPI_Recv(notice.data(), count, MPI_INT64_T, status.MPI_SOURCE, kLeavingTag, control,
           MPI_STATUS_IGNORE);
  return notice;
}
}  // namespace

void announce_leaving(const std::vector<int64_t>& notice) {
  if (control == MPI_COMM_NULL) return;
  int me = 0, size = 1;
  MPI_Comm_rank(control, &me);
  MPI_Comm_size(control, &size);
  leaving_notice = notice;
  leaving_sends.clear();
  for (int peer = 0; peer < size; ++peer) {
    if (peer == me) continue;
    leaving_sends.emplace_back(MPI_REQUEST_NULL);
    MPI_Isend(leaving_notice.data(), static_cast<int>(leaving_notice.size()), MPI_INT64_T, peer,
              kLeavingTag, control, &leaving_sends.back());
  }
}

std::optional<std::pair<int, std::vector<int64_t>>> poll_leaving() {
  if (control == MPI_COMM_NULL) return std::nullopt;
  int arrived = 0;
  MPI_Status status;
  MPI_Iprobe(MPI_ANY_SOURCE, kLeavingTag, control, &arrived, &status);
  if (!arrived) return std::nullopt;
  return std::make_pair(status.MPI_SOURCE, receive_notice(status));
}

void finish_leaving(int polled) {
  if (control == MPI_COMM_NULL) return;
  int size = 1;
  MPI_Comm_size(control, &size);
  for (int i = polled; i < size - 1; ++i) {
    MPI_Status status;
    MPI_Probe(MPI_ANY_SOURCE, kLeavingTag, control, &status);
    receive_notice(status);
  }
  MPI_Waitall(static_cast<int>(leaving_sends.size()), leaving_sends.data(), MPI_STATUSES_IGNORE);
  leaving_sends.clear();
}

void report_waiting(int rank, const std::string& report) {
  if (control == MPI_COMM_NULL) return;
  MPI_Request request = MPI_REQUEST_NULL;  // the job is torn down next: nobody waits for it
  MPI_Isend(report.data(), static_cast<int>(report.size()), MPI_CHAR, rank, kWaitingTag, control,
            &request);
  MPI_Request_free(&request);
}

namespace {
constexpr int kRollCallTag = 3;  // then one tag per kind, in Control's order
int tag_of(Control kind) {
  return kRollCallTag + static_cast<int>(kind);
}
// Sends in flight, each with its bytes (a deque keeps both where MPI was told they are).
std::mutex control_sends_mutex;
std::deque<std::pair<MPI_Request, std::string>> control_sends;
}  // namespace

void send_control(int rank, Control kind, std::string bytes) {
  if (control == MPI_COMM_NULL) return;
  std::lock_guard lock(control_sends_mutex);
  while (!control_sends.empty()) {
    int done = 0;
    MPI_Test(&control_sends.front().first, &done, MPI_STATUS_IGNORE);
    if (!done) break;
    control_sends.pop_front();
  }
  auto& [request, kept] = control_sends.emplace_back(MPI_REQUEST_NULL, std::move(bytes));
  MPI_Isend(kept.data(), static_cast<int>(kept.size()), MPI_BYTE, rank, tag_of(kind), control,
            &request);
}

std::optional<std::pair<int, std::string>> poll_control(Control kind) {
  if (control == MPI_COMM_NULL) return std::nullopt;
  int arrived = 0;
  MPI_Status status;
  MPI_Iprobe(MPI_ANY_SOURCE, tag_of(kind), control, &arrived, &status);
  if (!arrived) return std::nullopt;
  int length = 0;
  MPI_Get_count(&status, MPI_BYTE, &length);
  std::string bytes(static_cast<size_t>(std::max(length, 0)), '\0');
  MPI_Recv(bytes.data(), length, MPI_BYTE, status.MPI_SOURCE, tag_of(kind), control,
           MPI_STATUS_IGNORE);
  return std::make_pair(status.MPI_SOURCE, std::move(bytes));
}

void finalize() {
  {
    std::lock_guard lock(control_sends_mutex);
    for (auto& [request, bytes] : control_sends) MPI_Request_free(&request);
    control_sends.clear();
  }
  if (control != MPI_COMM_NULL) MPI_Comm_free(&control);
  if (!we_initialized) return;  // whoever started MPI finishes it
  MPI_Finalize();
  we_initialized = false;
}

void abort_job(int code) {
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

}  // namespace mpi

}  // namespace weave::dist::detail

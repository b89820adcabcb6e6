// Groups, the per-group communication queues, argument checks, fingerprint checks and the
// watchdog that turns a hung collective into a clear job-wide failure.
#include "weave/distributed/distributed.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <numeric>
#include <thread>

#include "weave/distributed/communicator.h"
#include "weave/kernels/kernels.h"
#include "weave/ops/ops.h"
#include "weave/tensor/cuda/runtime.h"

namespace weave::dist {

using detail::Communicator;

namespace {

// ---- a world of one, for programs not started by mpirun --------------------------------

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
  void barrier() override {}
  std::unique_ptr<Communicator> split(const std::vector<int>&) override {
    return std::make_unique<LocalCommunicator>();
  }

 private:
  static void move(const void* in, void* out, int64_t n, DType t) {
    if (in != out) std::memmove(out, in, static_cast<size_t>(n) * itemsize(t));
  }
};

// ---- operations, fingerprints ------------------------------------------------------------

enum class Op : int32_t {
  AllReduce,
  Broadcast,
  Reduce,
  AllGather,
  AllGatherV,
  ReduceScatter,
  Gather,
  Scatter,
  AllToAll,
  AllToAllV,
  Barrier,
  NewGroup,
  Send,
  Recv
};
const char* op_name(Op op) {
  static const char* names[] = {
      "all_reduce",     "broadcast", "reduce",  "all_gather", "all_gather_uneven",
      "reduce_scatter", "gather",    "scatter", "all_to_all", "all_to_all",
      "barrier",        "new_group", "send",    "recv"};
  return names[static_cast<int>(op)];
}

// What every rank of the group must agree on before a collective runs.
struct Fingerprint {
  uint64_t sequence = 0;
  int32_t op = 0;
  int32_t dtype = -1;
  int32_t rank = 0;
  int32_t root = -1;
  int32_t ndim = -1;  // -1: no tensor
  int32_t reduce_op = -1;
  int64_t dims[kMaxDims] = {};  // -1 where ranks may differ (uneven sizes)
  int64_t extra = 0;            // op-specific (a hash of a new group's ranks)
};

std::string describe(const Fingerprint& f) {
  std::string text = op_name(static_cast<Op>(f.op));
  if (f.ndim >= 0) {
    std::vector<std::string> dims;
    for (int i = 0; i < f.ndim; ++i)
      dims.push_back(f.dims[i] < 0 ? "*" : std::to_string(f.dims[i]));
    text += fmt::format("({} [{}]", dtype_name(static_cast<DType>(f.dtype)), fmt::join(dims, ", "));
    if (f.root >= 0) text += fmt::format(", root {}", f.root);
    text += ")";
  }
  return fmt::format("{} #{}", text, f.sequence);
}

bool same_call(const Fingerprint& a, const Fingerprint& b) {
  if (a.sequence != b.sequence || a.op != b.op || a.dtype != b.dtype || a.root != b.root ||
      a.ndim != b.ndim || a.reduce_op != b.reduce_op || a.extra != b.extra)
    return false;
  return std::equal(a.dims, a.dims + std::max(a.ndim, 0), b.dims);
}

// ---- global state ------------------------------------------------------------------------

struct Task {
  std::function<void()> run;
  std::shared_ptr<Work::State> state;
  Fingerprint print;
};

struct Runtime {
  bool up = false;
  Backend backend = Backend::MPI;
  bool uses_mpi = false;
  double timeout_s = 300;
  bool check = false;
  int rank = 0, size = 1, local_rank = 0;
  Device device = kCPU;
  std::shared_ptr<Group::Impl> world;
  std::mutex groups_mutex;
  std::vector<std::weak_ptr<Group::Impl>> groups;
  std::thread watchdog;
  std::atomic<bool> stop_watchdog{false};
};

Runtime& runtime() {
  static Runtime* r = new Runtime;  // never destroyed: worker threads may outlive statics
  return *r;
}

Runtime& live(const char* op) {
  Runtime& r = runtime();
  WEAVE_CHECK(r.up, op,
              "the distributed module is not initialized; hint: call weave::dist::init() first");
  return r;
}

double env_double(const char* name, double fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  double d = std::strtod(v, &end);
  WEAVE_CHECK(end != v && *end == '\0' && d > 0, "init", "{}='{}' is not a positive number", name,
              v);
  return d;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

// ---- Work --------------------------------------------------------------------------------

struct Work::State {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;

  void finish(std::exception_ptr e) {
    {
      std::lock_guard lock(mutex);
      done = true;
      error = e;
    }
    cv.notify_all();
  }
};

void Work::wait() const {
  if (!state_) return;
  std::unique_lock lock(state_->mutex);
  state_->cv.wait(lock, [&] { return state_->done; });
  if (state_->error) std::rethrow_exception(state_->error);
}

bool Work::is_completed() const {
  if (!state_) return true;
  std::lock_guard lock(state_->mutex);
  return state_->done;
}

// ---- groups and their queues -------------------------------------------------------------

struct Group::Impl {
  std::vector<int> ranks;
  int my_rank = -1;
  std::unique_ptr<Communicator> comm;         // host (MPI or local); null on non-members
  std::unique_ptr<Communicator> device_comm;  // NCCL, for CUDA tensors; null otherwise

  /// Where a tensor's bytes travel: NCCL for CUDA tensors when there is one, else the host.
  Communicator* route(const Tensor& t) const {
    return t.device().is_cuda() && device_comm ? device_comm.get() : comm.get();
  }
  uint64_t next_sequence = 0;  // collectives issued (caller side, program order)

  std::mutex mutex;
  std::condition_variable cv;
  std::deque<Task> tasks;
  bool busy = false;  // an op of this group is running (inline or on the worker)
  bool stopping = false;
  std::thread worker;

  // Read by the watchdog: when the running op started (0: none) and what it is.
  std::atomic<int64_t> running_since{0};
  Fingerprint running;  // guarded by mutex

  ~Impl() { stop(); }

  void stop() {
    {
      std::lock_guard lock(mutex);
      stopping = true;
    }
    cv.notify_all();
    if (worker.joinable()) worker.join();
  }

  // Marks the op started (caller holds the lock); the watchdog formats its description only
  // if it ever has to report it, so the latency path formats nothing.
  void start_running(const Fingerprint& print) {
    busy = true;
    running = print;
    running_since.store(now_ns(), std::memory_order_release);
  }
  void finish_running() {
    running_since.store(0, std::memory_order_release);
    {
      std::lock_guard lock(mutex);
      busy = false;
    }
    cv.notify_all();
  }

  void worker_loop() {
    for (;;) {
      Task task;
      {
        std::unique_lock lock(mutex);
        cv.wait(lock, [&] { return !busy && (stopping || !tasks.empty()); });
        if (tasks.empty()) return;  // stopping, queue drained
        task = std::move(tasks.front());
        tasks.pop_front();
        start_running(task.print);
      }
      std::exception_ptr error;
      try {
        task.run();
      } catch (...) {
        error = std::current_exception();
      }
      finish_running();
      task.state->finish(error);
    }
  }

  // Issues one op in program order: inline when blocking and nothing is queued (no thread
  // hand-off, no allocation on the latency path), else on the worker thread.
  template <class Body>
  Work submit(const Fingerprint& print, Body&& body, bool async_op) {
    if (!async_op) {
      std::unique_lock lock(mutex);
      if (tasks.empty() && !busy) {
        start_running(print);
        lock.unlock();
        struct Finish {
          Impl* self;
          ~Finish() { self->finish_running(); }
        } finish{this};
        body();
        return Work();
      }
    }
    auto state = std::make_shared<Work::State>();
    {
      std::lock_guard lock(mutex);
      tasks.push_back({std::function<void()>(std::forward<Body>(body)), state, print});
      if (!worker.joinable()) worker = std::thread([this] { worker_loop(); });
    }
    cv.notify_all();
    Work work(state);
    if (!async_op) work.wait();
    return work;
  }

  // Waits until everything issued so far has run.
  void drain() {
    std::unique_lock lock(mutex);
    cv.wait(lock, [&] { return tasks.empty() && !busy; });
  }
};

Group::Group() : impl_(live("world").world) {}
const std::vector<int>& Group::ranks() const {
  return impl_->ranks;
}
int Group::size() const {
  return static_cast<int>(impl_->ranks.size());
}
int Group::rank() const {
  return impl_->my_rank;
}
bool Group::contains(int global) const {
  return std::find(impl_->ranks.begin(), impl_->ranks.end(), global) != impl_->ranks.end();
}
int Group::global_rank(int group_rank) const {
  WEAVE_CHECK(group_rank >= 0 && group_rank < size(), "group",
              "group rank {} is outside group {} of size {}", group_rank, str(), size());
  return impl_->ranks[group_rank];
}
std::string Group::str() const {
  return fmt::format("[{}]", fmt::join(impl_->ranks, ", "));
}

Group world() {
  return Group(live("world").world);
}

namespace {

std::shared_ptr<Group::Impl> make_group(std::vector<int> ranks,
                                        std::unique_ptr<Communicator> comm) {
  Runtime& r = runtime();
  auto impl = std::make_shared<Group::Impl>();
  impl->ranks = std::move(ranks);
  auto it = std::find(impl->ranks.begin(), impl->ranks.end(), r.rank);
  impl->my_rank = it == impl->ranks.end() ? -1 : static_cast<int>(it - impl->ranks.begin());
  impl->comm = std::move(comm);
  std::lock_guard lock(r.groups_mutex);
  r.groups.push_back(impl);
  return impl;
}

void watchdog_loop() {
  Runtime& r = runtime();
  const auto limit = static_cast<int64_t>(r.timeout_s * 1e9);
  while (!r.stop_watchdog.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    std::lock_guard lock(r.groups_mutex);
    for (auto& weak : r.groups) {
      auto group = weak.lock();
      if (!group) continue;
      int64_t since = group->running_since.load(std::memory_order_acquire);
      if (since == 0 || now_ns() - since < limit) continue;
      std::string what;
      {
        std::lock_guard group_lock(group->mutex);
        what = fmt::format("{} on group [{}]", describe(group->running),
                           fmt::join(group->ranks, ", "));
      }
      std::fprintf(stderr,
                   "[weave] rank %d: %s did not complete within %g s (WEAVE_TIMEOUT_S); a rank "
                   "of the group probably skipped it or is stuck; tearing the job down\n",
                   r.rank, what.c_str(), r.timeout_s);
      std::fflush(stderr);
      if (r.uses_mpi) detail::mpi::abort_job(1);
      std::_Exit(1);
    }
  }
}

}  // namespace

void init(Backend backend, InitOptions options) {
  Runtime& r = runtime();
  WEAVE_CHECK(!r.up, "init", "already initialized; hint: call finalize() first");
  r.backend = backend;
  r.timeout_s = options.timeout_s > 0 ? options.timeout_s : env_double("WEAVE_TIMEOUT_S", 300);
  if (options.check_collectives) {
    r.check = *options.check_collectives;
  } else {
    const char* v = std::getenv("WEAVE_CHECK_COLLECTIVES");
    r.check = v != nullptr && std::strcmp(v, "0") != 0 && *v != '\0';
  }
  std::unique_ptr<Communicator> comm;
  r.uses_mpi = detail::mpi::launched();
  if (r.uses_mpi) {
    comm = detail::mpi::init_world();
    r.local_rank = detail::mpi::local_rank();
  } else {
    comm = std::make_unique<LocalCommunicator>();
    r.local_rank = 0;
  }
  r.rank = comm->rank();
  r.size = comm->size();
  r.device = kCPU;
  if (backend == Backend::NCCL) {
    WEAVE_CHECK(detail::nccl::available(), "init",
                "weave was built without NCCL; hint: configure with -DWEAVE_WITH_CUDA=ON "
                "-DWEAVE_WITH_NCCL=ON, or use Backend::MPI");
    WEAVE_CHECK(cuda::is_available(), "init",
                "the NCCL backend needs a CUDA device; none is visible{}",
                cuda::device_count() == 0 ? " (or weave was built without CUDA)" : "");
    std::vector<int> devices = options.cuda_devices;
    if (devices.empty())
      for (int d = 0; d < cuda::device_count(); ++d) devices.push_back(d);
    for (int d : devices)
      WEAVE_CHECK(d >= 0 && d < cuda::device_count(), "init",
                  "cuda_devices lists cuda:{}, but {} are visible", d, cuda::device_count());
    r.device = Device::cuda(devices[r.local_rank % devices.size()]);
  }
  std::vector<int> all(r.size);
  std::iota(all.begin(), all.end(), 0);
  r.world = make_group(all, std::move(comm));
  if (backend == Backend::NCCL)
    r.world->device_comm = detail::nccl::init_world(*r.world->comm, r.device.index);
  r.up = true;
  r.stop_watchdog = false;
  r.watchdog = std::thread(watchdog_loop);
}

bool initialized() {
  return runtime().up;
}

void finalize() {
  Runtime& r = runtime();
  if (!r.up) return;
  {
    std::vector<std::shared_ptr<Group::Impl>> groups;
    {
      std::lock_guard lock(r.groups_mutex);
      for (auto& weak : r.groups)
        if (auto g = weak.lock()) groups.push_back(g);
    }
    for (auto& g : groups) g->drain();  // the watchdog still guards this
    for (auto& g : groups) {
      g->stop();
      g->device_comm.reset();
      g->comm.reset();
    }
  }
  r.stop_watchdog = true;
  if (r.watchdog.joinable()) r.watchdog.join();
  {
    std::lock_guard lock(r.groups_mutex);
    r.groups.clear();
  }
  r.world.reset();
  if (r.uses_mpi) detail::mpi::finalize();
  r.up = false;
}

int rank() {
  return live("rank").rank;
}
int world_size() {
  return live("world_size").size;
}
int local_rank() {
  return live("local_rank").local_rank;
}
Backend backend() {
  return live("backend").backend;
}
Device device() {
  return live("device").device;
}

// ---- collectives -------------------------------------------------------------------------

namespace {

// Everything one collective call needs from its caller.
struct Call {
  Op op;
  const Group& group;
  const char* name;
  Call(Op o, const Group& g) : op(o), group(g), name(op_name(o)) {}
};

Group::Impl& member(const Call& c) {
  live(c.name);
  Group::Impl& g = *c.group.impl();
  WEAVE_CHECK(g.my_rank >= 0, c.name,
              "rank {} is not in group {}; hint: only members may call its collectives",
              runtime().rank, c.group.str());
  return g;
}

void check_root(const Call& c, int root) {
  WEAVE_CHECK(
      root >= 0 && root < c.group.size(), c.name,
      "root {} is outside group {} (group ranks are 0..{}); hint: roots are positions in the group",
      root, c.group.str(), c.group.size() - 1);
}

void check_tensor(const Call& c, const Tensor& t, const char* what) {
  WEAVE_CHECK(t.defined(), c.name, "{} is an undefined tensor", what);
  const Runtime& r = runtime();
  if (t.device().is_cuda() && r.backend == Backend::NCCL)
    WEAVE_CHECK(t.device() == r.device, c.name,
                "{} is on {}, but this rank's NCCL device is {}; hint: move it with "
                ".to(weave::dist::device())",
                what, t.device(), r.device);
  WEAVE_CHECK(t.numel() <= int64_t{0x7fffffff}, c.name,
              "{} has {} elements; collectives move at most 2^31 - 1 elements at once", what,
              t.numel());
}

void check_same(const Call& c, const Tensor& a, const Tensor& b) {
  WEAVE_CHECK(a.dtype() == b.dtype(), c.name, "input is {} but output is {}", a.dtype(), b.dtype());
  WEAVE_CHECK(a.device() == b.device(), c.name, "input is on {} but output is on {}", a.device(),
              b.device());
}

// Host-side contiguous stand-in for a tensor (itself when already contiguous on the host):
// the MPI backend moves host memory, so CUDA tensors are staged through it.
Device wire_device(const Tensor& t) {  // NCCL moves CUDA memory itself; MPI moves host memory
  return t.device().is_cuda() && runtime().backend == Backend::NCCL ? t.device() : kCPU;
}
Tensor staged(const Tensor& t) {
  if (t.device() == wire_device(t) && t.is_contiguous()) return t;
  Tensor stage = empty(t.shape(), {.dtype = t.dtype(), .device = wire_device(t)});
  kernels::copy(t, stage);
  return stage;
}
Tensor staging_for(const Tensor& t) {  // output-only staging: no copy in
  if (t.device() == wire_device(t) && t.is_contiguous()) return t;
  return empty(t.shape(), {.dtype = t.dtype(), .device = wire_device(t)});
}
void land(const Tensor& stage, const Tensor& target) {
  if (!stage.is_same(target)) kernels::copy(stage, target);
  target.storage()->bump_version();
}

Fingerprint fingerprint(const Call& c, uint64_t sequence, const Tensor* shape_of, int root,
                        std::optional<ReduceOp> reduce_op, bool uneven_first_dim) {
  Fingerprint f;
  f.sequence = sequence;
  f.op = static_cast<int32_t>(c.op);
  f.rank = runtime().rank;
  f.root = root;
  f.reduce_op = reduce_op ? static_cast<int32_t>(*reduce_op) : -1;
  if (shape_of) {
    f.dtype = static_cast<int32_t>(shape_of->dtype());
    f.ndim = shape_of->dim();
    for (int i = 0; i < shape_of->dim(); ++i) f.dims[i] = shape_of->shape()[i];
    if (uneven_first_dim && f.ndim > 0) f.dims[0] = -1;
  }
  return f;
}

// Compares this rank's fingerprint with the group's; raises on every rank if any differs.
void verify(Group::Impl& g, const Fingerprint& mine) {
  std::vector<Fingerprint> all(g.ranks.size());
  g.comm->all_gather(&mine, all.data(), sizeof(Fingerprint), kUInt8);
  bool agree = true;
  for (const Fingerprint& f : all) agree = agree && same_call(f, all[0]);
  if (agree) return;
  std::vector<std::string> calls;
  for (const Fingerprint& f : all)
    calls.push_back(fmt::format("rank {} called {}", f.rank, describe(f)));
  WEAVE_FAIL(op_name(static_cast<Op>(mine.op)),
             "collective mismatch in group [{}]: {}; hint: every rank of a group must issue the "
             "same collectives, with the same dtypes and shapes, in the same order",
             fmt::join(g.ranks, ", "), fmt::join(calls, ", "));
}

// Runs `body` on the group in program order, after the fingerprint check when it is on.
// Point-to-point calls (collective = false) take no sequence number and no check.
template <class Body>
Work issue(const Call& c, Fingerprint print, bool collective, Body&& body, bool async_op) {
  Group::Impl& g = member(c);
  if (collective) print.sequence = g.next_sequence++;
  if (runtime().check && collective)
    return g.submit(
        print,
        [&g, print, body = std::forward<Body>(body)] {
          verify(g, print);
          body();
        },
        async_op);
  return g.submit(print, std::forward<Body>(body), async_op);
}

void divide(const Tensor& t, int size) {
  Tensor scalar = empty({}, {.dtype = t.dtype(), .device = t.device()});
  kernels::fill(scalar, size);
  kernels::binary(kernels::BinaryOp::Div, t,
                  make_view(scalar, t.shape(), Dims::filled(t.dim(), 0), 0), t);
}

ReduceOp wire_op(ReduceOp op) {
  return op == ReduceOp::Avg ? ReduceOp::Sum : op;
}

void check_reduce_op(const Call& c, ReduceOp op, DType dtype) {
  WEAVE_CHECK(op != ReduceOp::Avg || is_floating(dtype), c.name,
              "avg needs a floating dtype, found {}; hint: sum, then divide", dtype);
}

// Checks `big` is `parts` copies of `small` stacked along dim 0 ([parts * n, ...] vs [n, ...];
// a 0-d small pairs with a 1-d big of `parts` elements).
void check_stacked(const Call& c, const Tensor& big, const Tensor& small, int parts,
                   const char* big_name, const char* small_name) {
  Shape expected = small.shape();
  if (expected.empty()) expected = Shape{1};
  expected[0] *= parts;
  WEAVE_CHECK(big.shape() == expected, c.name,
              "{} has shape {}, expected {} ({} x {} {} along dim 0 over group {})", big_name,
              big.shape(), expected, parts, small_name, small.shape(), c.group.str());
}

int64_t sum_of(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

}  // namespace

Work all_reduce(const Tensor& tensor, ReduceOp op, const Group& group, bool async_op) {
  return all_reduce(tensor, tensor, op, group, async_op);
}

Work all_reduce(const Tensor& input, const Tensor& output, ReduceOp op, const Group& group,
                bool async_op) {
  Call c(Op::AllReduce, group);
  check_tensor(c, input, "input");
  check_tensor(c, output, "output");
  check_same(c, input, output);
  WEAVE_CHECK(input.shape() == output.shape(), c.name, "input {} and output {} differ in shape",
              input.shape(), output.shape());
  check_reduce_op(c, op, input.dtype());
  Tensor in = staged(input);
  Tensor out = input.is_same(output) ? in : staging_for(output);
  Group::Impl* g = group.impl().get();
  return issue(
      c, fingerprint(c, 0, &input, -1, op, false), true,
      [comm = g->route(in), g, in, out, output, op] {
        comm->all_reduce(in.data_ptr(), out.data_ptr(), in.numel(), in.dtype(), wire_op(op));
        if (op == ReduceOp::Avg) divide(out, comm->size());
        land(out, output);
      },
      async_op);
}

Work broadcast(const Tensor& tensor, int root, const Group& group, bool async_op) {
  Call c(Op::Broadcast, group);
  check_tensor(c, tensor, "tensor");
  Group::Impl& g = member(c);
  check_root(c, root);
  Tensor buffer = g.my_rank == root ? staged(tensor) : staging_for(tensor);
  return issue(
      c, fingerprint(c, 0, &tensor, root, std::nullopt, false), true,
      [comm = g.route(buffer), g = &g, buffer, tensor, root] {
        comm->broadcast(buffer.data_ptr(), buffer.numel(), buffer.dtype(), root);
        if (g->my_rank != root) land(buffer, tensor);
      },
      async_op);
}

Work reduce(const Tensor& tensor, ReduceOp op, int root, const Group& group, bool async_op) {
  Call c(Op::Reduce, group);
  check_tensor(c, tensor, "tensor");
  Group::Impl& g = member(c);
  check_root(c, root);
  check_reduce_op(c, op, tensor.dtype());
  Tensor buffer = staged(tensor);
  return issue(
      c, fingerprint(c, 0, &tensor, root, op, false), true,
      [comm = g.route(buffer), g = &g, buffer, tensor, root, op] {
        comm->reduce(buffer.data_ptr(), buffer.data_ptr(), buffer.numel(), buffer.dtype(),
                     wire_op(op), root);
        if (g->my_rank != root) return;
        if (op == ReduceOp::Avg) divide(buffer, comm->size());
        land(buffer, tensor);
      },
      async_op);
}

Work all_gather(const Tensor& output, const Tensor& input, const Group& group, bool async_op) {
  Call c(Op::AllGather, group);
  check_tensor(c, input, "input");
  check_tensor(c, output, "output");
  check_same(c, input, output);
  Group::Impl& g = member(c);
  check_stacked(c, output, input, group.size(), "output", "input");
  Tensor in = staged(input), out = staging_for(output);
  return issue(
      c, fingerprint(c, 0, &input, -1, std::nullopt, false), true,
      [comm = g.route(in), g = &g, in, out, output] {
        comm->all_gather(in.data_ptr(), out.data_ptr(), in.numel(), in.dtype());
        land(out, output);
      },
      async_op);
}

Tensor all_gather_uneven(const Tensor& input, const Group& group) {
  Call c(Op::AllGatherV, group);
  check_tensor(c, input, "input");
  WEAVE_CHECK(input.dim() >= 1, c.name, "expected at least 1 dimension, found a 0-d tensor");
  Group::Impl& g = member(c);
  Tensor rows = full({1}, static_cast<double>(input.size(0)), {.dtype = kInt64});
  Tensor all_rows = empty({group.size()}, {.dtype = kInt64});
  all_gather(all_rows, rows, group);
  int64_t row = 1;
  for (int d = 1; d < input.dim(); ++d) row *= input.shape()[d];
  std::vector<int64_t> counts;
  Shape shape = input.shape();
  shape[0] = 0;
  for (int64_t n : all_rows.to_vector<int64_t>()) {
    counts.push_back(n * row);
    shape[0] += n;
  }
  Tensor in = staged(input),
         out = empty(shape, {.dtype = input.dtype(), .device = wire_device(input)});
  issue(
      c, fingerprint(c, 0, &input, -1, std::nullopt, true), true,
      [comm = g.route(in), g = &g, in, out, counts] {
        comm->all_gather_v(in.data_ptr(), out.data_ptr(), counts, in.dtype());
      },
      false);
  return input.device().is_cpu() ? out : out.to(input.device());
}

Work reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op, const Group& group,
                    bool async_op) {
  Call c(Op::ReduceScatter, group);
  check_tensor(c, input, "input");
  check_tensor(c, output, "output");
  check_same(c, input, output);
  Group::Impl& g = member(c);
  check_stacked(c, input, output, group.size(), "input", "output");
  check_reduce_op(c, op, input.dtype());
  Tensor in = staged(input), out = staging_for(output);
  return issue(
      c, fingerprint(c, 0, &input, -1, op, false), true,
      [comm = g.route(in), g = &g, in, out, output, op] {
        comm->reduce_scatter(in.data_ptr(), out.data_ptr(), out.numel(), in.dtype(), wire_op(op));
        if (op == ReduceOp::Avg) divide(out, comm->size());
        land(out, output);
      },
      async_op);
}

Work gather(const Tensor& output, const Tensor& input, int root, const Group& group,
            bool async_op) {
  Call c(Op::Gather, group);
  check_tensor(c, input, "input");
  Group::Impl& g = member(c);
  check_root(c, root);
  const bool is_root = g.my_rank == root;
  Tensor out;
  if (is_root) {
    check_tensor(c, output, "output");
    check_same(c, input, output);
    check_stacked(c, output, input, group.size(), "output", "input");
    out = staging_for(output);
  }
  Tensor in = staged(input);
  return issue(
      c, fingerprint(c, 0, &input, root, std::nullopt, false), true,
      [comm = g.route(in), g = &g, in, out, output, root, is_root] {
        comm->gather(in.data_ptr(), is_root ? out.data_ptr() : nullptr, in.numel(), in.dtype(),
                     root);
        if (is_root) land(out, output);
      },
      async_op);
}

Work scatter(const Tensor& output, const Tensor& input, int root, const Group& group,
             bool async_op) {
  Call c(Op::Scatter, group);
  check_tensor(c, output, "output");
  Group::Impl& g = member(c);
  check_root(c, root);
  const bool is_root = g.my_rank == root;
  Tensor in;
  if (is_root) {
    check_tensor(c, input, "input");
    check_same(c, input, output);
    check_stacked(c, input, output, group.size(), "input", "output");
    in = staged(input);
  }
  Tensor out = staging_for(output);
  return issue(
      c, fingerprint(c, 0, &output, root, std::nullopt, false), true,
      [comm = g.route(out), g = &g, in, out, output, root, is_root] {
        comm->scatter(is_root ? in.data_ptr() : nullptr, out.data_ptr(), out.numel(), out.dtype(),
                      root);
        land(out, output);
      },
      async_op);
}

Work all_to_all(const Tensor& output, const Tensor& input, const Group& group, bool async_op) {
  Call c(Op::AllToAll, group);
  check_tensor(c, input, "input");
  check_tensor(c, output, "output");
  check_same(c, input, output);
  WEAVE_CHECK(input.dim() >= 1 && input.size(0) % group.size() == 0, c.name,
              "dimension 0 of input {} must divide evenly among the {} ranks of group {}",
              input.shape(), group.size(), group.str());
  WEAVE_CHECK(output.shape() == input.shape(), c.name, "output {} must have the input's shape {}",
              output.shape(), input.shape());
  Group::Impl& g = member(c);
  Tensor in = staged(input), out = staging_for(output);
  return issue(
      c, fingerprint(c, 0, &input, -1, std::nullopt, false), true,
      [comm = g.route(in), g = &g, in, out, output] {
        comm->all_to_all(in.data_ptr(), out.data_ptr(), in.numel() / comm->size(), in.dtype());
        land(out, output);
      },
      async_op);
}

Work all_to_all(const Tensor& output, const Tensor& input,
                const std::vector<int64_t>& output_splits, const std::vector<int64_t>& input_splits,
                const Group& group, bool async_op) {
  Call c(Op::AllToAllV, group);
  check_tensor(c, input, "input");
  check_tensor(c, output, "output");
  check_same(c, input, output);
  Group::Impl& g = member(c);
  const size_t n = static_cast<size_t>(group.size());
  WEAVE_CHECK(input_splits.size() == n && output_splits.size() == n, c.name,
              "expected {} splits (one per rank of group {}), found {} input and {} output splits",
              n, group.str(), input_splits.size(), output_splits.size());
  for (int64_t v : input_splits)
    WEAVE_CHECK(v >= 0, c.name, "splits must be non-negative, found {}", v);
  for (int64_t v : output_splits)
    WEAVE_CHECK(v >= 0, c.name, "splits must be non-negative, found {}", v);
  WEAVE_CHECK(input.dim() >= 1 && output.dim() >= 1, c.name,
              "input and output need at least 1 dimension");
  WEAVE_CHECK(sum_of(input_splits) == input.size(0), c.name,
              "input splits add up to {}, but input has {} rows", sum_of(input_splits),
              input.size(0));
  WEAVE_CHECK(sum_of(output_splits) == output.size(0), c.name,
              "output splits add up to {}, but output has {} rows", sum_of(output_splits),
              output.size(0));
  for (int d = 1; d < input.dim(); ++d)
    WEAVE_CHECK(output.dim() == input.dim() && output.shape()[d] == input.shape()[d], c.name,
                "input {} and output {} must agree beyond dimension 0", input.shape(),
                output.shape());
  int64_t row = 1;
  for (int d = 1; d < input.dim(); ++d) row *= input.shape()[d];
  std::vector<int64_t> send_counts, recv_counts;
  for (size_t j = 0; j < n; ++j) {
    send_counts.push_back(input_splits[j] * row);
    recv_counts.push_back(output_splits[j] * row);
  }
  Tensor in = staged(input), out = staging_for(output);
  const bool check = runtime().check;
  const std::string group_text = group.str();
  return issue(
      c, fingerprint(c, 0, &input, -1, std::nullopt, true), true,
      [comm = g.route(in), g = &g, in, out, output, send_counts, recv_counts, input_splits,
       output_splits, check, group_text] {
        if (check) {  // do the ranks' splits pair up? everyone learns the answer
          std::vector<int64_t> ones(input_splits.size(), 1), told(input_splits.size());
          g->comm->all_to_all_v(input_splits.data(), ones, told.data(), ones, kInt64);
          int64_t bad = told != output_splits;
          g->comm->all_reduce(&bad, &bad, 1, kInt64, ReduceOp::Max);
          WEAVE_CHECK(
              !bad, "all_to_all",
              "the splits in group {} do not pair up: rank r's output_splits[j] must equal rank "
              "j's input_splits[r] (this rank expects {} and is sent {})",
              group_text, output_splits, told);
        }
        comm->all_to_all_v(in.data_ptr(), send_counts, out.data_ptr(), recv_counts, in.dtype());
        land(out, output);
      },
      async_op);
}

namespace {
void check_peer(const Call& c, const Group::Impl& g, int peer) {
  WEAVE_CHECK(peer >= 0 && peer < static_cast<int>(g.ranks.size()) && peer != g.my_rank, c.name,
              "peer {} must be another rank of group {} (group ranks 0..{}, this is {})", peer,
              c.group.str(), g.ranks.size() - 1, g.my_rank);
}
}  // namespace

Work send(const Tensor& tensor, int dst, const Group& group, int tag, bool async_op) {
  Call c(Op::Send, group);
  check_tensor(c, tensor, "tensor");
  Group::Impl& g = member(c);
  check_peer(c, g, dst);
  Tensor buffer = staged(tensor);
  return issue(
      c, fingerprint(c, 0, &tensor, dst, std::nullopt, false), false,
      [comm = g.route(buffer), g = &g, buffer, dst, tag] {
        comm->send(buffer.data_ptr(), buffer.numel(), buffer.dtype(), dst, tag);
      },
      async_op);
}

Work recv(const Tensor& tensor, int src, const Group& group, int tag, bool async_op) {
  Call c(Op::Recv, group);
  check_tensor(c, tensor, "tensor");
  Group::Impl& g = member(c);
  check_peer(c, g, src);
  Tensor buffer = staging_for(tensor);
  return issue(
      c, fingerprint(c, 0, &tensor, src, std::nullopt, false), false,
      [comm = g.route(buffer), g = &g, buffer, tensor, src, tag] {
        comm->recv(buffer.data_ptr(), buffer.numel(), buffer.dtype(), src, tag);
        land(buffer, tensor);
      },
      async_op);
}

void barrier(const Group& group) {
  Call c(Op::Barrier, group);
  Group::Impl& g = member(c);
  issue(
      c, fingerprint(c, 0, nullptr, -1, std::nullopt, false), true,
      [g = &g] { g->comm->barrier(); }, false);
}

void synchronize(const std::vector<Tensor>& tensors, int root, const Group& group) {
  for (const Tensor& t : tensors) broadcast(t, root, group);
}

Group new_group(const std::vector<int>& ranks) {
  Runtime& r = live("new_group");
  WEAVE_CHECK(!ranks.empty(), "new_group", "a group needs at least one rank");
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  WEAVE_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(), "new_group",
              "ranks {} list a rank twice", ranks);
  WEAVE_CHECK(sorted.front() >= 0 && sorted.back() < r.size, "new_group",
              "ranks {} must lie in [0, {}) (the world size)", ranks, r.size);
  Call c(Op::NewGroup, world());
  Fingerprint print = fingerprint(c, 0, nullptr, -1, std::nullopt, false);
  for (int v : ranks) print.extra = print.extra * 1000003 + v + 1;  // same list, same value
  auto host = std::make_shared<std::unique_ptr<Communicator>>();
  auto device = std::make_shared<std::unique_ptr<Communicator>>();
  Group::Impl* w = r.world.get();
  issue(
      c, print, true,
      [w, ranks, host, device] {
        *host = w->comm->split(ranks);
        if (w->device_comm) *device = w->device_comm->split(ranks);
      },
      false);
  auto impl = make_group(ranks, std::move(*host));
  impl->device_comm = std::move(*device);
  return Group(impl);
}

}  // namespace weave::dist

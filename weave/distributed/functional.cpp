// Differentiable collectives. Each op pairs a forward with its exact adjoint, written side by
// side from the same non-recording helpers (axis variants: move the axis to the front, run the
// axis-0 collective, move it back).
#include "weave/distributed/functional.h"

#include <chrono>
#include <numeric>

#include "weave/distributed/functional_support.h"
#include "weave/distributed/staging.h"
#include "weave/distributed/tags.h"
#include "weave/ops/ops.h"

namespace weave::dist::functional {

namespace detail {

// ---- non-recording building blocks -------------------------------------------------------

void check_input(const Tensor& x, const char* op) {
  WEAVE_CHECK(x.defined(), op, "input is an undefined tensor");
}

int axis_of(const Tensor& x, int64_t axis, const char* op) {
  WEAVE_CHECK(x.dim() >= 1, op,
              "expected a tensor with at least 1 dimension, found a 0-d one; hint: reshape({{1}})");
  return normalize_dim(axis, x.dim(), op);
}

// x with `axis` moved to the front, contiguous.
Tensor front(const Tensor& x, int axis) {
  Dims order{axis};
  for (int d = 0; d < x.dim(); ++d)
    if (d != axis) order.push_back(d);
  return x.permute(order).contiguous();
}

// Undoes front(): the first dim goes back to `axis`.
Tensor unfront(const Tensor& y, int axis) {
  Dims order;
  for (int d = 1; d <= axis; ++d) order.push_back(d);
  order.push_back(0);
  for (int d = axis + 1; d < y.dim(); ++d) order.push_back(d);
  return y.permute(order).contiguous();
}

Shape with_dim(Shape s, int axis, int64_t size) {
  s[axis] = size;
  return s;
}

TensorOptions like(const Tensor& x) {
  return {.dtype = x.dtype(), .device = x.device()};
}

Tensor token_like(const Tensor& x) {
  return empty({0}, like(x));
}

Tensor raw_all_reduce(const Tensor& x, ReduceOp op, const Group& g) {
  Tensor out = empty(x.shape(), like(x));
  dist::all_reduce(x.contiguous(), out, op, g);
  return out;
}

Tensor raw_all_gather(const Tensor& x, int axis, const Group& g) {
  Tensor xf = front(x, axis);
  Tensor out = empty(with_dim(xf.shape(), 0, xf.size(0) * g.size()), like(x));
  dist::all_gather(out, xf, g);
  return unfront(out, axis);
}

void check_divisible(const Tensor& x, int axis, const Group& g, const char* op) {
  WEAVE_CHECK(x.size(axis) % g.size() == 0, op,
              "axis {} has size {}, which does not divide among the {} ranks of group {}", axis,
              x.size(axis), g.size(), g.str());
}

Tensor raw_reduce_scatter(const Tensor& x, int axis, const Group& g, const char* op) {
  check_divisible(x, axis, g, op);
  Tensor xf = front(x, axis);
  Tensor out = empty(with_dim(xf.shape(), 0, xf.size(0) / g.size()), like(x));
  dist::reduce_scatter(out, xf, ReduceOp::Sum, g);
  return unfront(out, axis);
}

// Root gets the inputs concatenated along axis; others get an undefined tensor.
Tensor raw_gather(const Tensor& x, int root, int axis, const Group& g) {
  Tensor xf = front(x, axis);
  const bool is_root = g.rank() == root;
  Tensor out = is_root ? empty(with_dim(xf.shape(), 0, xf.size(0) * g.size()), like(x)) : Tensor();
  dist::gather(out, xf, root, g);
  return is_root ? unfront(out, axis) : Tensor();
}

// Every rank gets piece r (of shape `piece`, in x's layout) of root's x.
Tensor raw_scatter(const Tensor& x, int root, int axis, const Shape& piece, DType dtype,
                   Device device, const Group& g) {
  Tensor xf = g.rank() == root ? front(x, axis) : Tensor();
  Shape piece_front{piece[axis]};
  for (int d = 0; d < piece.size(); ++d)
    if (d != axis) piece_front.push_back(piece[d]);
  Tensor out = empty(piece_front, {.dtype = dtype, .device = device});
  dist::scatter(out, xf, root, g);
  return unfront(out, axis);
}

// Splits along a, exchanges piece j with rank j, concatenates what arrives along c.
Tensor raw_all_to_all(const Tensor& x, int a, int c, const Group& g, const char* op) {
  check_divisible(x, a, g, op);
  const int n = g.size(), r = x.dim();
  Tensor xf = front(x, a);  // [S_a, R...]
  Shape blocks_shape{n, xf.size(0) / n};
  for (int d = 1; d < xf.dim(); ++d) blocks_shape.push_back(xf.size(d));
  Tensor blocks = xf.reshape(blocks_shape);  // [n, S_a / n, R...]
  Tensor received = empty(blocks_shape, like(x));
  dist::all_to_all(received, blocks, g);
  // Back to x's axis order with the source rank first: [n, S'...].
  Dims order{0};
  for (int d = 0; d < r; ++d) order.push_back(d == a ? 1 : 2 + (d < a ? d : d - 1));
  Tensor ordered = received.permute(order);
  // Rank dim next to axis c, then merged into it (rank-major: concatenation in rank order).
  Dims merge;
  for (int d = 1; d <= c; ++d) merge.push_back(d);
  merge.push_back(0);
  for (int d = c + 1; d <= r; ++d) merge.push_back(d);
  Shape out_shape = with_dim(x.shape(), a, x.size(a) / n);
  out_shape[c] *= n;
  return ordered.permute(merge).reshape(out_shape);
}

// The metadata a receiver needs to allocate: shape, dtype, the sender's device type (so the
// receiver's buffer takes the same route: NCCL for CUDA under Backend::NCCL, MPI for host
// memory), and whether it is differentiable.
struct Meta {
  Shape shape;
  DType dtype = kFloat32;
  DeviceType device_type = DeviceType::CPU;
  bool requires_grad = false;
};
constexpr int kMetaSize = 4 + kMaxDims;

Tensor pack(const Meta& m) {
  std::vector<int64_t> v(kMetaSize, 0);
  v[0] = m.requires_grad;
  v[1] = static_cast<int64_t>(m.dtype);
  v[2] = static_cast<int64_t>(m.device_type);
  v[3] = m.shape.size();
  for (int d = 0; d < m.shape.size(); ++d) v[4 + d] = m.shape[d];
  return from_vector(v);
}
Meta unpack(const Tensor& t) {
  auto v = t.to_vector<int64_t>();
  Meta m;
  m.requires_grad = v[0] != 0;
  m.dtype = static_cast<DType>(v[1]);
  m.device_type = static_cast<DeviceType>(v[2]);
  for (int d = 0; d < v[3]; ++d) m.shape.push_back(v[4 + d]);
  return m;
}
Meta meta_of(const Tensor& x) {
  return {x.shape(), x.dtype(), x.device().type,
          x.requires_grad() && autograd::GradMode::is_enabled()};
}

// Where a rank with no input of its own puts what it receives: on the sender's device type,
// so both ends route the bytes the same way (a CUDA receiver of a CPU sender under NCCL would
// call NCCL while the sender calls MPI, and both would wait forever).
Device receiver_device(const Meta& meta, const char* op) {
  return dist::detail::receiving_device(meta.device_type, op);
}

// Forward values and backward gradients never share a channel.
constexpr int kForwardTag = tags::kRemoteForward, kBackwardTag = tags::kRemoteBackward;

// ---- recording: record and quietly live in functional_support.h ------------------------

bool wants_grad(const Tensor& x) {
  return x.defined() && x.requires_grad();
}

bool alone_in(const Group& g, const char* op) {
  WEAVE_CHECK(g.rank() >= 0, op,
              "rank {} is not in group {}; hint: only members may call its collectives",
              dist::rank(), g.str());
  return g.size() == 1;
}

void check_root(int root, const Group& g, const char* op) {
  WEAVE_CHECK(root >= 0 && root < g.size(), op, "root {} is outside group {} (group ranks 0..{})",
              root, g.str(), g.size() - 1);
}

}  // namespace detail

using namespace detail;

// ---- all_reduce -----------------------------------------------------------------------------

namespace {
Tensor all_reduce_linear(const Tensor& x, ReduceOp op, const Group& g, const char* name,
                         const char* backward_name) {
  check_input(x, name);
  if (alone_in(g, name)) return x;
  Tensor y = quietly([&] { return raw_all_reduce(x, op, g); });
  // d(sum_r x_r) / dx_q = 1 for every q: the gradient is the sum (or mean) of the gradients
  return record(backward_name, x, y, wants_grad(x), [&] {
    return
        [op, g](const BackwardArgs& args) -> Grads { return {raw_all_reduce(args.grad(), op, g)}; };
  });
}

Tensor all_reduce_extremum(const Tensor& x, ReduceOp op, const Group& g, const char* name,
                           const char* backward_name) {
  check_input(x, name);
  if (alone_in(g, name)) return x;
  Tensor y = quietly([&] { return raw_all_reduce(x, op, g); });
  // Only the ranks whose input equals the result receive gradient, split among all of them.
  return record(backward_name, x, y, wants_grad(x), [&] {
    return [xs = autograd::SavedTensor(x), ys = autograd::SavedTensor(y),
            g](const BackwardArgs& args) -> Grads {
      Tensor winner = eq(xs.unpack(), ys.unpack()).to(args.grad().dtype());
      Tensor ties = raw_all_reduce(winner, ReduceOp::Sum, g);
      Tensor total = raw_all_reduce(args.grad(), ReduceOp::Sum, g);
      return {winner * total / maximum(ties, ones_like(ties))};
    };
  });
}
}  // namespace

Tensor all_reduce_sum(const Tensor& x, const Group& g) {
  return all_reduce_linear(x, ReduceOp::Sum, g, "all_reduce_sum", "AllReduceSumBackward");
}
Tensor all_reduce_avg(const Tensor& x, const Group& g) {
  return all_reduce_linear(x, ReduceOp::Avg, g, "all_reduce_avg", "AllReduceAvgBackward");
}
Tensor all_reduce_max(const Tensor& x, const Group& g) {
  return all_reduce_extremum(x, ReduceOp::Max, g, "all_reduce_max", "AllReduceMaxBackward");
}
Tensor all_reduce_min(const Tensor& x, const Group& g) {
  return all_reduce_extremum(x, ReduceOp::Min, g, "all_reduce_min", "AllReduceMinBackward");
}

// ---- broadcast / reduce_sum -------------------------------------------------------------

Tensor broadcast(const Tensor& x, int root, const Group& g) {
  check_root(root, g, "broadcast");
  const bool is_root = g.rank() == root;
  if (is_root) check_input(x, "broadcast");
  if (alone_in(g, "broadcast")) return x;
  Meta meta = is_root ? meta_of(x) : Meta{};  // read before grad mode is switched off
  Tensor y = quietly([&] {
    Tensor header = is_root ? pack(meta) : empty({kMetaSize}, {.dtype = kInt64});
    dist::broadcast(header, root, g);
    meta = unpack(header);
    Tensor out = is_root ? x.contiguous().clone()
                         : empty(meta.shape, {.dtype = meta.dtype,
                                              .device = receiver_device(meta, "broadcast")});
    dist::broadcast(out, root, g);
    return out;
  });
  // adjoint: every rank's gradient summed onto root; other ranks' inputs get zero
  return record("BroadcastBackward", x, y, meta.requires_grad, [&] {
    return
        [root, g, is_root, in = x.defined() ? x.detach() : x](const BackwardArgs& args) -> Grads {
          Tensor sum = args.grad().contiguous().clone();
          dist::reduce(sum, ReduceOp::Sum, root, g);
          if (is_root) return {sum};
          return {in.defined() ? zeros_like(in) : Tensor()};
        };
  });
}

Tensor reduce_sum(const Tensor& x, int root, const Group& g) {
  check_input(x, "reduce_sum");
  check_root(root, g, "reduce_sum");
  if (alone_in(g, "reduce_sum")) return x;
  const bool is_root = g.rank() == root;
  Tensor y = quietly([&] {
    Tensor sum = x.contiguous().clone();
    dist::reduce(sum, ReduceOp::Sum, root, g);
    return is_root ? sum : token_like(x);
  });
  // adjoint: root's gradient broadcast to every rank
  return record("ReduceSumBackward", x, y, wants_grad(x), [&] {
    return [root, g, is_root, shape = x.shape(),
            options = like(x)](const BackwardArgs& args) -> Grads {
      Tensor grad = is_root ? args.grad().contiguous().clone() : empty(shape, options);
      dist::broadcast(grad, root, g);
      return {grad};
    };
  });
}

// ---- all_gather / reduce_scatter ------------------------------------------------------------

Tensor all_gather(const Tensor& x, int64_t axis, const Group& g) {
  check_input(x, "all_gather");
  const int a = axis_of(x, axis, "all_gather");
  if (alone_in(g, "all_gather")) return x;
  Tensor y = quietly([&] { return raw_all_gather(x, a, g); });
  // adjoint: reduce_scatter_sum along the same axis
  return record("AllGatherBackward", x, y, wants_grad(x), [&] {
    return [a, g](const BackwardArgs& args) -> Grads {
      return {raw_reduce_scatter(args.grad(), a, g, "all_gather")};
    };
  });
}

Tensor reduce_scatter_sum(const Tensor& x, int64_t axis, const Group& g) {
  check_input(x, "reduce_scatter_sum");
  const int a = axis_of(x, axis, "reduce_scatter_sum");
  check_divisible(x, a, g, "reduce_scatter_sum");
  if (alone_in(g, "reduce_scatter_sum")) return x;
  Tensor y = quietly([&] { return raw_reduce_scatter(x, a, g, "reduce_scatter_sum"); });
  // adjoint: all_gather along the same axis
  return record("ReduceScatterSumBackward", x, y, wants_grad(x), [&] {
    return
        [a, g](const BackwardArgs& args) -> Grads { return {raw_all_gather(args.grad(), a, g)}; };
  });
}

// ---- gather / scatter ------------------------------------------------------------------

Tensor gather(const Tensor& x, int root, int64_t axis, const Group& g) {
  check_input(x, "gather");
  check_root(root, g, "gather");
  const int a = axis_of(x, axis, "gather");
  if (alone_in(g, "gather")) return x;
  const bool is_root = g.rank() == root;
  Tensor y = quietly([&] {
    Tensor all = raw_gather(x, root, a, g);
    return is_root ? all : token_like(x);
  });
  // adjoint: root's gradient scattered back, piece r to rank r
  return record("GatherBackward", x, y, wants_grad(x), [&] {
    return [root, a, g, is_root, shape = x.shape(),
            options = like(x)](const BackwardArgs& args) -> Grads {
      return {raw_scatter(is_root ? args.grad() : Tensor(), root, a, shape, options.dtype,
                          options.device, g)};
    };
  });
}

Tensor scatter(const Tensor& x, int root, int64_t axis, const Group& g) {
  check_root(root, g, "scatter");
  const bool is_root = g.rank() == root;
  const bool alone = alone_in(g, "scatter");
  int a = 0;
  Meta meta;
  if (is_root) {
    // Only the root can judge its input; the header it broadcasts tells the others whether it
    // did, so a rejected input is an error on every rank instead of a hang on the others.
    try {
      check_input(x, "scatter");
      a = axis_of(x, axis, "scatter");
      check_divisible(x, a, g, "scatter");
    } catch (const Error&) {
      if (!alone) {
        NoGradGuard no_grad;
        Tensor rejected = full({kMetaSize}, -1.0, {.dtype = kInt64});
        dist::broadcast(rejected, root, g);
      }
      throw;
    }
    meta = {with_dim(x.shape(), a, x.size(a) / g.size()), x.dtype(), x.device().type,
            meta_of(x).requires_grad};
  }
  if (alone) return x;
  Tensor y = quietly([&] {
    Tensor header = empty({kMetaSize}, {.dtype = kInt64});
    if (is_root) header = pack(meta);
    dist::broadcast(header, root, g);
    WEAVE_CHECK(header.to_vector<int64_t>()[3] >= 0, "scatter",
                "the root (group rank {}) rejected its input, so there is nothing to scatter; see "
                "the root's error",
                root);
    meta = unpack(header);
    if (!is_root) a = normalize_dim(axis, meta.shape.size(), "scatter");
    return raw_scatter(x, root, a, meta.shape, meta.dtype,
                       is_root ? x.device() : receiver_device(meta, "scatter"), g);
  });
  // adjoint: the pieces' gradients gathered on root; other ranks' inputs get zero
  return record("ScatterBackward", x, y, meta.requires_grad, [&] {
    return [root, a, g, is_root,
            in = x.defined() ? x.detach() : x](const BackwardArgs& args) -> Grads {
      Tensor all = raw_gather(args.grad(), root, a, g);
      if (is_root) return {all};
      return {in.defined() ? zeros_like(in) : Tensor()};
    };
  });
}

// ---- all_to_all ------------------------------------------------------------------------

Tensor all_to_all(const Tensor& x, int64_t split_axis, int64_t concat_axis, const Group& g) {
  check_input(x, "all_to_all");
  const int a = axis_of(x, split_axis, "all_to_all"), c = axis_of(x, concat_axis, "all_to_all");
  check_divisible(x, a, g, "all_to_all");
  if (alone_in(g, "all_to_all")) return x;
  Tensor y = quietly([&] { return raw_all_to_all(x, a, c, g, "all_to_all"); });
  // adjoint: the exchange run backwards (split along concat_axis, concatenate along split_axis)
  return record("AllToAllBackward", x, y, wants_grad(x), [&] {
    return [a, c, g](const BackwardArgs& args) -> Grads {
      return {raw_all_to_all(args.grad(), c, a, g, "all_to_all")};
    };
  });
}

// ---- point to point ----------------------------------------------------------------------

namespace {

thread_local double receive_wait = 0;

// Blocking receive, timed into receive_wait.
void timed_recv(const Tensor& buffer, int src, const Group& g, int tag) {
  const auto start = std::chrono::steady_clock::now();
  dist::recv(buffer, src, g, tag);
  receive_wait += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

double receive_wait_seconds() {
  return receive_wait;
}

Tensor remote_send(const Tensor& x, int dst, const Group& g) {
  check_input(x, "remote_send");
  const Meta meta = meta_of(x);  // read before grad mode is switched off
  // non-blocking: a stage may send forward and then receive from the same peer (1F1B)
  Tensor token = quietly([&] {
    dist::isend(pack(meta), dst, g, kForwardTag);
    dist::isend(x.contiguous(), dst, g, kForwardTag);
    return token_like(x);
  });
  // adjoint: the gradient of what dst received comes back from dst
  return record("RemoteSendBackward", x, token, wants_grad(x), [&] {
    return [dst, g, shape = x.shape(), options = like(x)](const BackwardArgs&) -> Grads {
      Tensor grad = empty(shape, options);
      timed_recv(grad, dst, g, kBackwardTag);
      return {grad};
    };
  });
}

Tensor remote_recv(int src, const Group& g) {
  Meta meta;
  Tensor y = quietly([&] {
    Tensor header = empty({kMetaSize}, {.dtype = kInt64});
    timed_recv(header, src, g, kForwardTag);
    meta = unpack(header);
    Tensor out =
        empty(meta.shape, {.dtype = meta.dtype, .device = receiver_device(meta, "remote_recv")});
    timed_recv(out, src, g, kForwardTag);
    return out;
  });
  // adjoint: send this tensor's gradient back to src
  return record("RemoteRecvBackward", Tensor(), y, meta.requires_grad, [&] {
    return [src, g](const BackwardArgs& args) -> Grads {
      dist::isend(args.grad().contiguous(), src, g, kBackwardTag);
      return {Tensor()};
    };
  });
}

}  // namespace weave::dist::functional

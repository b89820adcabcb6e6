// The collective front ends: argument checks, staging between a tensor and the wire buffer,
// and the body each call submits to its group's queue.
#include <array>
#include <numeric>
#include <optional>

#include "weave/autograd/engine.h"
#include "weave/distributed/agreement.h"
#include "weave/distributed/staging.h"
#include "weave/kernels/kernels.h"
#include "weave/ops/ops.h"
#include "weave/tensor/cuda/device_runtime.h"
#include "weave/tensor/tensor_impl.h"

namespace weave::dist {

using namespace detail;

namespace detail {

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

Device wire_device(const Tensor& t) {
  return t.device().is_cuda() && runtime().backend == Backend::NCCL ? t.device() : kCPU;
}
const Tensor& staging_for(const Tensor& t, Tensor& stage) {
  if (t.device() == wire_device(t) && t.is_contiguous()) return t;
  stage = empty(t.shape(), {.dtype = t.dtype(), .device = wire_device(t)});
  return stage;
}
const Tensor& staged(const Tensor& t, Tensor& stage) {
  const Tensor& wire = staging_for(t, stage);
  if (!wire.is_same(t)) kernels::copy(t, stage);
  return wire;
}
Tensor staged(const Tensor& t) {
  Tensor stage;
  return staged(t, stage);
}
Tensor staging_for(const Tensor& t) {
  Tensor stage;
  return staging_for(t, stage);
}
void land(const Tensor& stage, const Tensor& target) {
  if (!stage.is_same(target)) kernels::copy(stage, target);
  target.storage()->bump_version();
}
Device receiving_device(DeviceType sent_from, const char* op) {
  if (sent_from == DeviceType::CPU) return kCPU;
  if (dist::device().is_cuda()) return dist::device();  // Backend::NCCL: this rank's GPU
  WEAVE_CHECK(cuda::is_available(), op,
              "the sending rank's tensor is on CUDA, but this rank has no CUDA device; hint: send "
              "a CPU tensor (.cpu()), or give every rank a GPU");
  return Device::cuda(dist::local_rank() % cuda::device_count());
}

Fingerprint fingerprint(const Call& c, uint64_t sequence, const Tensor* shape_of, int root,
                        std::optional<ReduceOp> reduce_op, bool uneven_first_dim) {
  Fingerprint f;
  f.sequence = sequence;
  f.op = static_cast<int32_t>(c.op);
  f.rank = runtime().rank;
  f.root = root;
  f.reduce_op = reduce_op ? static_cast<int32_t>(*reduce_op) : -1;
  f.from_backward = autograd::in_backward() ? 1 : 0;
  if (shape_of) {
    f.dtype = static_cast<int32_t>(shape_of->dtype());
    f.ndim = shape_of->dim();
    for (int i = 0; i < shape_of->dim(); ++i) f.dims[i] = shape_of->shape()[i];
    if (uneven_first_dim && f.ndim > 0) f.dims[0] = -1;
    const bool on_device_comm = shape_of->device().is_cuda() && c.group.impl()->device_comm;
    f.wire = static_cast<int32_t>(on_device_comm ? DeviceType::CUDA : DeviceType::CPU);
  }
  return f;
}

}  // namespace detail

namespace {

// float16 holds nothing past 65504, so a sum overflows where the mean it ends in would fit (four
// ranks' 40000): its mean is summed from each rank's share, value / size, as ncclAvg does, and
// no partial sum then exceeds the largest input. Wider dtypes keep the sum, then the scaling.
bool divides_first(DType dtype) {
  return dtype == kFloat16;
}

// `in` / size into `out` (it may be `in`).
void scale_into(const Tensor& in, const Tensor& out, int size) {
  Tensor scalar = empty({}, {.dtype = in.dtype(), .device = in.device()});
  kernels::fill(scalar, 1.0 / size);
  kernels::binary(kernels::BinaryOp::Mul, in,
                  make_view(scalar, in.shape(), Dims::filled(in.dim(), 0), 0), out);
}

// A copy of `in` divided by size: the input a divides_first reduction sends (the caller's tensor
// stays as it was).
Tensor divided_copy(const Tensor& in, int size) {
  Tensor out = empty(in.shape(), {.dtype = in.dtype(), .device = in.device()});
  scale_into(in, out, size);
  return out;
}

// Avg's final step: the sum times 1/size (NCCL's ncclAvg does the same; a multiply runs at
// memory speed where a divide is bound by the divider). Exact when size is a power of two,
// else within one rounding of sum / size.
void scale_to_mean(const Tensor& t, int size) {
  scale_into(t, t, size);
}

// An Avg all_reduce of a large buffer runs in chunks, each scaled right after its sum while
// it is still in cache: one pass over memory instead of two.
constexpr int64_t kAvgChunkBytes = int64_t{1} << 20;

void all_reduce_avg(Communicator* comm, const Tensor& in, const Tensor& out) {
  if (comm->size() == 1) {  // the mean of one: no scaling pass
    if (in.data_ptr() != out.data_ptr())
      comm->all_reduce(in.data_ptr(), out.data_ptr(), in.numel(), in.dtype(), ReduceOp::Sum);
    return;
  }
  if (comm->all_reduce_mean(in.data_ptr(), out.data_ptr(), in.numel(), in.dtype())) return;
  if (divides_first(in.dtype())) {
    scale_into(in, out, comm->size());
    comm->all_reduce(out.data_ptr(), out.data_ptr(), out.numel(), out.dtype(), ReduceOp::Sum);
    return;
  }
  const int64_t total = in.numel(), item = int64_t(in.itemsize());
  const int64_t chunk = std::max<int64_t>(1, kAvgChunkBytes / item);
  if (total <= chunk) {
    comm->all_reduce(in.data_ptr(), out.data_ptr(), total, in.dtype(), ReduceOp::Sum);
    scale_to_mean(out, comm->size());
    return;
  }
  for (int64_t start = 0; start < total; start += chunk) {
    const int64_t count = std::min(chunk, total - start);
    comm->all_reduce(static_cast<const char*>(in.data_ptr()) + start * item,
                     static_cast<char*>(out.data_ptr()) + start * item, count, in.dtype(),
                     ReduceOp::Sum);
    scale_to_mean(make_view(out, {count}, {1}, out.offset() + start), comm->size());
  }
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
  Tensor in_stage, out_stage;
  const Tensor& in = staged(input, in_stage);
  const Tensor& out = input.is_same(output) ? in : staging_for(output, out_stage);
  Group::Impl* g = group.impl().get();
  return issue_on(
      c, fingerprint(c, 0, &input, -1, op, false), async_op,
      [comm = g->route(in), op](const Tensor& in, const Tensor& out, const Tensor& output) {
        if (op == ReduceOp::Avg)
          all_reduce_avg(comm, in, out);
        else
          comm->all_reduce(in.data_ptr(), out.data_ptr(), in.numel(), in.dtype(), op);
        land(out, output);
      },
      in, out, output);
}

Work broadcast(const Tensor& tensor, int root, const Group& group, bool async_op) {
  Call c(Op::Broadcast, group);
  check_tensor(c, tensor, "tensor");
  Group::Impl& g = member(c);
  check_root(c, root);
  Tensor stage;
  const Tensor& buffer = g.my_rank == root ? staged(tensor, stage) : staging_for(tensor, stage);
  return issue_on(
      c, fingerprint(c, 0, &tensor, root, std::nullopt, false), async_op,
      [comm = g.route(buffer), g = &g, root](const Tensor& buffer, const Tensor& tensor) {
        comm->broadcast(buffer.data_ptr(), buffer.numel(), buffer.dtype(), root);
        if (g->my_rank != root) land(buffer, tensor);
      },
      buffer, tensor);
}

Work reduce(const Tensor& tensor, ReduceOp op, int root, const Group& group, bool async_op) {
  Call c(Op::Reduce, group);
  check_tensor(c, tensor, "tensor");
  Group::Impl& g = member(c);
  check_root(c, root);
  check_reduce_op(c, op, tensor.dtype());
  Tensor buffer = staged(tensor);
  return issue_on(
      c, fingerprint(c, 0, &tensor, root, op, false), async_op,
      [comm = g.route(buffer), g = &g, root, op](const Tensor& buffer, const Tensor& tensor) {
        const bool first = op == ReduceOp::Avg && divides_first(buffer.dtype());
        const Tensor sent = first ? divided_copy(buffer, comm->size()) : buffer;
        comm->reduce(sent.data_ptr(), sent.data_ptr(), sent.numel(), sent.dtype(), wire_op(op),
                     root);
        if (g->my_rank != root) return;
        if (op == ReduceOp::Avg && !first) scale_to_mean(sent, comm->size());
        land(sent, tensor);
      },
      buffer, tensor);
}

Work all_gather(const Tensor& output, const Tensor& input, const Group& group, bool async_op) {
  Call c(Op::AllGather, group);
  check_tensor(c, input, "input");
  check_tensor(c, output, "output");
  check_same(c, input, output);
  Group::Impl& g = member(c);
  check_stacked(c, output, input, group.size(), "output", "input");
  Tensor in_stage, out_stage;
  const Tensor &in = staged(input, in_stage), &out = staging_for(output, out_stage);
  return issue_on(
      c, fingerprint(c, 0, &input, -1, std::nullopt, false), async_op,
      [comm = g.route(in)](const Tensor& in, const Tensor& out, const Tensor& output) {
        comm->all_gather(in.data_ptr(), out.data_ptr(), in.numel(), in.dtype());
        land(out, output);
      },
      in, out, output);
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
  issue_on(
      c, fingerprint(c, 0, &input, -1, std::nullopt, true), false,
      [comm = g.route(in), &counts](const Tensor& in, const Tensor& out) {
        comm->all_gather_v(in.data_ptr(), out.data_ptr(), counts, in.dtype());
      },
      in, out);
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
  Tensor in_stage, out_stage;
  const Tensor &in = staged(input, in_stage), &out = staging_for(output, out_stage);
  return issue_on(
      c, fingerprint(c, 0, &input, -1, op, false), async_op,
      [comm = g.route(in), op](const Tensor& in, const Tensor& out, const Tensor& output) {
        const bool first = op == ReduceOp::Avg && divides_first(in.dtype());
        const Tensor sent = first ? divided_copy(in, comm->size()) : in;
        comm->reduce_scatter(sent.data_ptr(), out.data_ptr(), out.numel(), in.dtype(), wire_op(op));
        if (op == ReduceOp::Avg && !first) scale_to_mean(out, comm->size());
        land(out, output);
      },
      in, out, output);
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
  return issue_on(
      c, fingerprint(c, 0, &input, root, std::nullopt, false), async_op,
      [comm = g.route(in), root, is_root](const Tensor& in, const Tensor& out,
                                          const Tensor& output) {
        comm->gather(in.data_ptr(), is_root ? out.data_ptr() : nullptr, in.numel(), in.dtype(),
                     root);
        if (is_root) land(out, output);
      },
      in, out, output);
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
  return issue_on(
      c, fingerprint(c, 0, &output, root, std::nullopt, false), async_op,
      [comm = g.route(out), root, is_root](const Tensor& in, const Tensor& out,
                                           const Tensor& output) {
        comm->scatter(is_root ? in.data_ptr() : nullptr, out.data_ptr(), out.numel(), out.dtype(),
                      root);
        land(out, output);
      },
      in, out, output);
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
  Tensor in_stage, out_stage;
  const Tensor &in = staged(input, in_stage), &out = staging_for(output, out_stage);
  return issue_on(
      c, fingerprint(c, 0, &input, -1, std::nullopt, false), async_op,
      [comm = g.route(in)](const Tensor& in, const Tensor& out, const Tensor& output) {
        comm->all_to_all(in.data_ptr(), out.data_ptr(), in.numel() / comm->size(), in.dtype());
        land(out, output);
      },
      in, out, output);
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
  Tensor in_stage, out_stage;
  const Tensor &in = staged(input, in_stage), &out = staging_for(output, out_stage);
  const bool check = runtime().check == CheckMode::Full;
  const std::string group_text = group.str();
  return issue_on(
      c, fingerprint(c, 0, &input, -1, std::nullopt, true), async_op,
      [comm = g.route(in), g = &g, send_counts, recv_counts, input_splits, output_splits, check,
       group_text](const Tensor& in, const Tensor& out, const Tensor& output) {
        if (check) {  // do the ranks' splits pair up? everyone learns the answer
          std::vector<int64_t> ones(input_splits.size(), 1), told(input_splits.size());
          g->comm->all_to_all_v(input_splits.data(), ones, told.data(), ones, kInt64);
          int64_t bad = told != output_splits;
          max_words(*g->comm, g->board.get(), std::span(&bad, 1));
          WEAVE_CHECK(
              !bad, "all_to_all",
              "the splits in group {} do not pair up: rank r's output_splits[j] must equal rank "
              "j's input_splits[r] (this rank expects {} and is sent {})",
              group_text, output_splits, told);
        }
        comm->all_to_all_v(in.data_ptr(), send_counts, out.data_ptr(), recv_counts, in.dtype());
        land(out, output);
      },
      in, out, output);
}

void barrier(const Group& group) {
  Call c(Op::Barrier, group);
  Group::Impl& g = member(c);
  issue(
      c, fingerprint(c, 0, nullptr, -1, std::nullopt, false), true,
      [g = &g] { g->comm->barrier(); }, false);
}

void broadcast_tensors(const std::vector<Tensor>& tensors, int root, const Group& group) {
  for (const Tensor& t : tensors) broadcast(t, root, group);
}

}  // namespace weave::dist

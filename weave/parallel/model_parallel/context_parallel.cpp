// Context parallelism: ring attention (one autograd node whose forward and backward run the ring
// with the fused attention kernels) and all-to-all attention (composed of differentiable ops).
#include "weave/parallel/model_parallel/context_parallel.h"
#include "weave/parallel/model_parallel/context_parallel_pairs.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <exception>
#include <vector>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/autograd/node.h"
#include "weave/distributed/functional.h"
#include "weave/distributed/tags.h"
#include "weave/ops/autocast.h"
#include "weave/ops/ops.h"
#include "weave/parallel/core/agree.h"
#include "weave/parallel/core/placement.h"
#include "weave/tensor/tensor_impl.h"
#include "weave/tensor/trace.h"

namespace weave::parallel {

namespace {

namespace F = dist::functional;
using detail::Pair, detail::pair_of, detail::pair_options, detail::pair_scores;
constexpr int kKeyValueTag = dist::tags::kRingKeyValue, kGradTag = dist::tags::kRingGradient;

// The chunks of the whole sequence rank r holds, in its order: one of n (Contiguous) or two of
// 2n (ZigZag).
std::vector<int64_t> chunks_of(int r, int n, SequenceLayout layout) {
  if (layout == SequenceLayout::Contiguous) return {r};
  return {r, 2 * int64_t(n) - 1 - r};
}

int64_t chunk_count(int n, SequenceLayout layout) {
  return layout == SequenceLayout::Contiguous ? n : 2 * int64_t(n);
}

const char* layout_name(SequenceLayout layout) {
  return layout == SequenceLayout::Contiguous ? "contiguous" : "zig-zag";
}

// What shard_sequence records on a part: rank `rank` of `group` cut `dims`-dimensional data along
// `axis` in `layout`.
struct SequencePart final : CutRecord {
  SequencePart(std::vector<int> group_in, int rank_in, SequenceLayout layout_in, int64_t axis_in,
               int64_t dims_in)
      : group(std::move(group_in)),
        rank(rank_in),
        layout(layout_in),
        axis(axis_in),
        dims(dims_in) {}
  std::vector<int> group;
  int rank;
  SequenceLayout layout;
  int64_t axis, dims;
  std::string describe() const override {
    return fmt::format("part {} of a sequence cut {} over group [{}] along axis {}", rank,
                       layout_name(layout), fmt::join(group, ", "), axis);
  }
};

// Arguments every rank checks, then agrees on (shapes and options alike on every rank).
void check_arguments(const Tensor& q, const Tensor& k, const Tensor& v, const dist::Group& group,
                     const ContextParallelOptions& options, const char* op) {
  WEAVE_CHECK(group.rank() >= 0, op, "rank {} is not in group {}", dist::rank(), group.str());
  // The scale travels as its bits (-0.0 as 0.0: they scale alike), so differing scales raise.
  const double scale = options.scale.value_or(0.0);
  const int64_t scale_bits = scale == 0 ? 0 : std::bit_cast<int64_t>(scale);
  std::vector<int64_t> facts(14, 0);
  const detail::ValueRange agreed = detail::check_together(
      [&] {
        WEAVE_CHECK(q.defined() && k.defined() && v.defined(), op, "q, k and v must be defined");
        WEAVE_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op,
                    "expected q, k, v of shape [B, H, T, D], found {}, {} and {}", q.shape(),
                    k.shape(), v.shape());
        WEAVE_CHECK(q.size(2) == k.size(2) && k.size(2) == v.size(2), op,
                    "q {}, k {} and v {} must hold the same positions of the sequence", q.shape(),
                    k.shape(), v.shape());
        WEAVE_CHECK(k.size(1) == v.size(1) && k.size(1) > 0 && q.size(1) % k.size(1) == 0, op,
                    "k {} and v {} need one head count that divides q's {} (grouped-query "
                    "attention)",
                    k.shape(), v.shape(), q.size(1));
        if (const Tensor& ids = options.document_ids; ids.defined())
          WEAVE_CHECK(
              (ids.dtype() == kInt64 || ids.dtype() == kInt32) &&
                  ((ids.dim() == 1 && ids.size(0) == q.size(2)) ||
                   (ids.dim() == 2 && ids.size(0) == q.size(0) && ids.size(1) == q.size(2))),
              op,
              "expected document_ids, int32 or int64, [{}] or [{}, {}] (this rank's "
              "positions), found {} {}",
              q.size(2), q.size(0), q.size(2), ids.dtype(), ids.shape());
        WEAVE_CHECK(options.window >= 0 && (options.window == 0 || options.causal), op,
                    "window {} needs causal = true and a size >= 0 (0: no window)", options.window);
        WEAVE_CHECK(options.layout != SequenceLayout::ZigZag || q.size(2) % 2 == 0, op,
                    "the zig-zag layout holds two equal chunks per rank, but this rank holds {} "
                    "positions; hint: the sequence must divide by twice the group size",
                    q.size(2));
        facts = {q.size(0),
                 q.size(1),
                 q.size(2),
                 q.size(3),
                 v.size(3),
                 int64_t(q.dtype()),
                 options.causal ? 1 : 0,
                 int64_t(options.layout),
                 options.scale.has_value() ? 1 : 0,
                 scale_bits,
                 k.size(1),
                 options.document_ids.defined() ? 1 : 0,
                 options.window,
                 std::bit_cast<int64_t>(options.softcap)};
      },
      group, op, facts);
  const char* names[] = {"batch",       "heads",           "local sequence length",
                         "head size",   "value head size", "dtype",
                         "causal flag", "layout",          "scale (set or not)",
                         "scale",       "key/value heads", "document ids (given or not)",
                         "window",      "softcap"};
  auto shown = [&](size_t i, int64_t value) {  // the scale's bits as the number they hold
    return i == 9 || i == 13 ? fmt::format("{}", std::bit_cast<double>(value))
                             : std::to_string(value);
  };
  for (size_t i = 0; i < facts.size(); ++i)
    WEAVE_CHECK(agreed.same(i), op,
                "the ranks of group {} pass different {} (from {} to {}); hint: every rank "
                "holds an equal part of one sequence, with the same options",
                group.str(), names[i], shown(i, agreed.lowest[i]), shown(i, agreed.highest[i]));
}

// A buffer on its way to the next rank of the ring, and the one arriving from the previous.
struct Shift {
  Tensor incoming;
  dist::Work exchange;
  Tensor wait() {
    exchange.wait();
    return incoming;
  }
};

// One grouped exchange in flight while the block is computed: a send alone would wait for its
// receive on NCCL, and a ring of such sends deadlocks.
Shift shift_to_next(const Tensor& buffer, const dist::Group& g, int tag) {
  const int n = g.size(), r = g.rank();
  Shift s;
  s.incoming = empty(buffer.shape(), {.dtype = buffer.dtype(), .device = buffer.device()});
  s.exchange = dist::send_recv(buffer, (r + 1) % n, s.incoming, (r + n - 1) % n, g, tag,
                               /*async_op=*/true);
  return s;
}

Tensor pack(const Tensor& k, const Tensor& v) {
  return cat({k.reshape({-1}), v.reshape({-1})});
}

// A query chunk of this rank against a key chunk of the block passing by: their indices in
// this rank's (and the block owner's) order, in the whole sequence, and how they attend.
struct BlockPair {
  size_t query, key;
  int64_t query_chunk, key_chunk;
  Pair pair;
};

// The ring's shared state: shapes, chunks and the compute dtype.
struct Ring {
  dist::Group group;
  SequenceLayout layout;
  bool causal;
  double scale;
  int64_t window = 0;
  double softcap = 0;
  Shape k_shape, v_shape;
  int64_t chunk = 0;  // positions per chunk
  std::vector<int64_t> mine;
  Tensor documents;  // the whole sequence's, int64 [B, T] in order (packed sequences), or none

  Tensor key(const Tensor& packed) const {
    return packed.narrow(0, 0, k_shape.numel()).reshape(k_shape);
  }
  Tensor value(const Tensor& packed) const {
    return packed.narrow(0, k_shape.numel(), v_shape.numel()).reshape(v_shape);
  }
  Tensor part(const Tensor& t, size_t index) const {
    return t.narrow(2, int64_t(index) * chunk, chunk);
  }
  // Calls f(BlockPair) for every pair the block of `owner` adds.
  template <class Fn>
  void for_each_pair(int owner, Fn&& f) const {
    const std::vector<int64_t> theirs = chunks_of(owner, group.size(), layout);
    for (size_t a = 0; a < mine.size(); ++a)
      for (size_t b = 0; b < theirs.size(); ++b) {
        const Pair pair = pair_of(mine[a], theirs[b], chunk, causal, window);
        if (pair != Pair::Skip) f(BlockPair{a, b, mine[a], theirs[b], pair});
      }
  }
  // A block's options: its pair's (pair_options), and with documents each side brings its own
  // (key blocks outside a query's document are skipped by the kernel).
  AttentionOptions options(const BlockPair& p) const {
    AttentionOptions o =
        pair_options(p.pair, p.query_chunk, p.key_chunk, chunk, scale, window, softcap);
    if (documents.defined()) {
      o.document_ids = documents.narrow(1, p.key_chunk * chunk, chunk);
      o.query_document_ids = documents.narrow(1, p.query_chunk * chunk, chunk);
    }
    return o;
  }
};

// Folds a block's normalized output o and log-sum-exp l into the running (out, lse) in place:
// out = (out e^(lse - m) + o e^(l - m)) / s, lse = m + log s. The kernel's +inf (a row that saw
// no key) counts as -inf here.
void merge(Tensor out, Tensor lse, const Tensor& o, const Tensor& l) {
  const TensorOptions options{.dtype = l.dtype(), .device = l.device()};
  const Tensor none = full({}, -INFINITY, options), zero = full({}, 0.0, options),
               one = full({}, 1.0, options);
  const Tensor block = where(isinf(l), none, l);
  const Tensor m = maximum(lse, block);
  const Tensor shift = where(isfinite(m), m, zero);
  const Tensor was = exp(lse - shift), add = exp(block - shift), total = was + add;
  const Tensor denominator = where(gt(total, zero), total, one);
  out.copy_((out * unsqueeze(was, -1) + o * unsqueeze(add, -1)) / unsqueeze(denominator, -1));
  lse.copy_(shift + log(total));
}

// Forward: this rank's queries against every rank's K/V block as it passes by.
std::pair<Tensor, Tensor> ring_forward(const Ring& ring, const Tensor& q, const Tensor& k,
                                       const Tensor& v, RingAttentionStats& stats) {
  const int n = ring.group.size(), r = ring.group.rank();
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), dv = v.size(3);
  const TensorOptions options{.dtype = q.dtype(), .device = q.device()};
  Tensor out = zeros({b, h, t, dv}, options), lse = full({b, h, t}, -INFINITY, options);
  Tensor current = pack(k, v);
  for (int s = 0; s < n; ++s) {
    Shift next;
    if (s + 1 < n) next = shift_to_next(current, ring.group, kKeyValueTag);
    const Tensor kb = ring.key(current), vb = ring.value(current);
    ring.for_each_pair((r + n - s) % n, [&](const BlockPair& p) {
      const AttentionOptions options = ring.options(p);
      const AttentionResult block = scaled_dot_product_attention_with_lse(
          ring.part(q, p.query), ring.part(kb, p.key), ring.part(vb, p.key), options);
      merge(ring.part(out, p.query), ring.part(lse, p.query), block.output, block.logsumexp);
      stats.score_elements += b * h * pair_scores(options, ring.chunk);
    });
    if (s + 1 < n) {
      const int64_t waited = trace::detail::now_ns();
      current = next.wait();
      stats.exchange_wait_s += double(trace::detail::now_ns() - waited) * 1e-9;
    }
  }
  // The kernels' convention for backward: +inf for a row that attends to nothing.
  lse.copy_(where(isinf(lse), full({}, INFINITY, options), lse));
  return {out, lse};
}

// Backward: dq stays here; each block's dK/dV accumulate as they travel with the block, and
// arrive back at their owner after one more step. A rank whose computation raises (`failure`
// set before or during the ring) still passes zeros around the ring, so its peers finish theirs.
std::vector<Tensor> ring_backward(const Ring& ring, const Tensor& grad, const Tensor& q,
                                  const Tensor& k, const Tensor& v, const Tensor& out,
                                  const Tensor& lse, std::exception_ptr& failure) {
  const int n = ring.group.size(), r = ring.group.rank();
  Tensor dq = zeros_like(q);
  std::vector<Tensor> lse_parts;  // each query chunk's lse, contiguous
  for (size_t a = 0; a < ring.mine.size(); ++a) lse_parts.push_back(ring.part(lse, a).contiguous());
  Tensor current = pack(k, v);
  Shift arriving;  // the dK/dV accumulated so far for the block held at this step
  for (int s = 0; s < n; ++s) {
    Shift next;
    if (s + 1 < n) next = shift_to_next(current, ring.group, kKeyValueTag);
    const Tensor kb = ring.key(current), vb = ring.value(current);
    Tensor local = zeros({current.numel()}, {.dtype = q.dtype(), .device = q.device()});
    const Tensor dk = ring.key(local), dv = ring.value(local);
    try {
      if (!failure)
        ring.for_each_pair((r + n - s) % n, [&](const BlockPair& p) {
          const AttentionGrads block = scaled_dot_product_attention_backward(
              ring.part(grad, p.query), ring.part(q, p.query), ring.part(kb, p.key),
              ring.part(vb, p.key), ring.part(out, p.query), lse_parts[p.query], ring.options(p));
          ring.part(dq, p.query).add_(block.q);
          ring.part(dk, p.key).add_(block.k);
          ring.part(dv, p.key).add_(block.v);
        });
    } catch (...) {
      failure = std::current_exception();
      local.zero_();
    }
    const Tensor accumulated = s == 0 ? local : arriving.wait() + local;
    arriving = shift_to_next(accumulated, ring.group, kGradTag);
    if (s + 1 < n) current = next.wait();
  }
  const Tensor mine = arriving.wait();
  return {dq, ring.key(mine).clone(), ring.value(mine).clone()};
}

// The whole sequence's documents in order, int64 [B, T], on every rank (one all_gather of the
// ranks' ids: a document may straddle ranks), or none.
Tensor whole_documents(const ContextParallelOptions& options, const Tensor& q,
                       const dist::Group& group) {
  const Tensor& ids = options.document_ids;
  if (!ids.defined()) return {};
  NoGradGuard no_grad;
  Tensor local = ids.to(kInt64);
  if (local.dim() == 1) local = local.unsqueeze(0).expand({q.size(0), q.size(2)});
  return gather_sequence(local.contiguous(), 1, group, options.layout).contiguous();
}

}  // namespace

Tensor ring_attention(const Tensor& q, const Tensor& k, const Tensor& v, const dist::Group& group,
                      const ContextParallelOptions& options) {
  const char* op = "ring_attention";
  // Autocast as the attention op does (every rank alike): the blocks then run on the cast inputs.
  if (autocast_dtype()) {
    constexpr const char* attention = "scaled_dot_product_attention";
    const Tensor qa = weave::detail::autocast_input(q, attention, "q"),
                 ka = weave::detail::autocast_input(k, attention, "k"),
                 va = weave::detail::autocast_input(v, attention, "v");
    if (!qa.is_same(q) || !ka.is_same(k) || !va.is_same(v))
      return ring_attention(qa, ka, va, group, options);
  }
  check_arguments(q, k, v, group, options, op);
  if (options.stats) *options.stats = {};
  // One rank holds the whole sequence, in order under either layout; an empty sequence (on
  // every rank: the lengths were agreed) has nothing to exchange.
  if (group.size() == 1 || q.size(2) == 0) {
    const int64_t t = q.size(2);
    const AttentionOptions whole{.causal = options.causal,
                                 .scale = options.scale,
                                 .document_ids = options.document_ids,
                                 .window = options.window,
                                 .softcap = options.softcap};
    if (options.stats)
      options.stats->score_elements = q.size(0) * q.size(1) * pair_scores(whole, t);
    return scaled_dot_product_attention(q, k, v, whole);
  }
  const DType dtype = compute_dtype(q.dtype());
  Tensor qc = q.to(dtype).contiguous(), kc = k.to(dtype).contiguous(),
         vc = v.to(dtype).contiguous();
  Ring ring{
      .group = group,
      .layout = options.layout,
      .causal = options.causal,
      .scale = options.scale.value_or(1.0 / std::sqrt(double(std::max<int64_t>(q.size(3), 1)))),
      .window = options.window,
      .softcap = options.softcap,
      .k_shape = kc.shape(),
      .v_shape = vc.shape(),
      .chunk = q.size(2) / int64_t(chunks_of(0, group.size(), options.layout).size()),
      .mine = chunks_of(group.rank(), group.size(), options.layout),
      .documents = whole_documents(options, q, group)};
  RingAttentionStats stats;
  const std::pair<Tensor, Tensor> forward = [&] {
    NoGradGuard no_grad;
    AutocastGuard blocks_as_they_are(kBFloat16, /*enabled=*/false);  // cast once, above
    return ring_forward(ring, qc, kc, vc, stats);
  }();
  const Tensor out = forward.first, lse = forward.second;
  if (options.stats) *options.stats = stats;
  Tensor result = out.to(q.dtype());
  // Its backward communicates: every rank runs it.
  return autograd::record_communicating(
             "RingAttentionBackward", {q, k, v}, {result}, autograd::should_record({q, k, v}),
             [ring, qs = autograd::SavedTensor(qc), ks = autograd::SavedTensor(kc),
              vs = autograd::SavedTensor(vc), out, lse, q_shape = qc.shape(), q_dtype = q.dtype(),
              k_dtype = k.dtype(),
              v_dtype = v.dtype()](const autograd::BackwardArgs& args) -> std::vector<Tensor> {
               NoGradGuard no_grad;
               // A rank that fails here (a saved tensor modified in place, an allocation) still
               // takes its turns in the ring, with zeros; then every rank learns of it.
               std::exception_ptr failure;
               const TensorOptions like{.dtype = out.dtype(), .device = out.device()};
               Tensor qv = zeros(q_shape, like), kv = zeros(ring.k_shape, like),
                      vv = zeros(ring.v_shape, like), grad = zeros_like(out);
               try {
                 qv = qs.unpack(), kv = ks.unpack(), vv = vs.unpack();
                 if (args.grad().defined()) grad = args.grad().to(qv.dtype()).contiguous();
               } catch (...) {
                 failure = std::current_exception();
               }
               std::vector<Tensor> grads = ring_backward(ring, grad, qv, kv, vv, out, lse, failure);
               detail::run_together("ring_attention", ring.group,
                                    "compute its part of ring attention's backward", [&] {
                                      if (failure) std::rethrow_exception(failure);
                                    });
               return {grads[0].to(q_dtype), grads[1].to(k_dtype), grads[2].to(v_dtype)};
             })
      .front();
}

namespace {

// Positions of the all-gathered sequence (chunks in rank order, each rank's in its layout) in
// natural order, and back.
Tensor natural_order(int n, int64_t chunk, bool inverse, Device device) {
  std::vector<int64_t> gathered;  // chunk index at each gathered position
  for (int r = 0; r < n; ++r)
    for (int64_t c : chunks_of(r, n, SequenceLayout::ZigZag)) gathered.push_back(c);
  std::vector<int64_t> index(gathered.size() * size_t(chunk));
  for (size_t p = 0; p < gathered.size(); ++p)
    for (int64_t e = 0; e < chunk; ++e) {
      const int64_t at_gathered = int64_t(p) * chunk + e, natural = gathered[p] * chunk + e;
      index[size_t(inverse ? at_gathered : natural)] = inverse ? natural : at_gathered;
    }
  return from_vector(index).to(device);
}

Tensor reorder(const Tensor& x, int64_t axis, int n, SequenceLayout layout, bool to_natural) {
  if (layout == SequenceLayout::Contiguous) return x;
  const int64_t chunk = x.size(int(axis)) / chunk_count(n, layout);
  return index_select(x, axis, natural_order(n, chunk, !to_natural, x.device()));
}

}  // namespace

Tensor context_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                         const ContextSplit& split, ContextParallelOptions options) {
  options.layout = split.layout;
  return split.mode == ContextParallelMode::Ring
             ? ring_attention(q, k, v, split.group, options)
             : all_to_all_attention(q, k, v, split.group, options);
}

Tensor all_to_all_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                            const dist::Group& group, const ContextParallelOptions& options) {
  const char* op = "all_to_all_attention";
  check_arguments(q, k, v, group, options, op);
  const int n = group.size();
  WEAVE_CHECK(q.size(1) % n == 0 && k.size(1) % n == 0, op,
              "heads do not divide over the {} ranks of group {} ({} query heads, {} key/value "
              "heads: both must); hint: use ring_attention, or a context group whose size "
              "divides the heads",
              n, group.str(), q.size(1), k.size(1));
  if (options.stats) *options.stats = {};
  // [B, H, T / n, D] -> [B, H / n, T, D]: heads split, sequence gathered (in rank order).
  auto to_heads = [&](const Tensor& x) {
    return reorder(F::all_to_all(x, 1, 2, group), 2, n, options.layout, /*to_natural=*/true);
  };
  // The collectives in one order on every rank (not left to the order arguments are evaluated).
  const Tensor documents = whole_documents(options, q, group);
  const Tensor qh = to_heads(q), kh = to_heads(k), vh = to_heads(v);
  Tensor y = scaled_dot_product_attention(qh, kh, vh,
                                          {.causal = options.causal,
                                           .scale = options.scale,
                                           .document_ids = documents,
                                           .window = options.window,
                                           .softcap = options.softcap});
  return F::all_to_all(reorder(y, 2, n, options.layout, /*to_natural=*/false), 2, 1, group);
}

Tensor shard_sequence(const Tensor& whole, int64_t axis, const dist::Group& group,
                      SequenceLayout layout) {
  const char* op = "shard_sequence";
  WEAVE_CHECK(group.rank() >= 0, op, "rank {} is not in group {}", dist::rank(), group.str());
  const int64_t dim = normalize_dim(axis, whole.dim(), op);
  const int64_t chunks = chunk_count(group.size(), layout);
  WEAVE_CHECK(whole.size(int(dim)) % chunks == 0, op,
              "a sequence of {} positions does not divide into {} equal chunks ({} ranks{}); "
              "hint: pad the sequence to a multiple of {}",
              whole.size(int(dim)), chunks, group.size(),
              layout == SequenceLayout::ZigZag ? ", two chunks each under ZigZag" : "", chunks);
  const int64_t chunk = whole.size(int(dim)) / chunks;
  std::vector<Tensor> parts;
  for (int64_t c : chunks_of(group.rank(), group.size(), layout))
    parts.push_back(whole.narrow(int(dim), c * chunk, chunk));
  Tensor part = parts.size() == 1 ? parts[0].contiguous() : cat(parts, dim);
  if (part.is_same(whole)) part = whole.clone();  // the record belongs to the part alone
  part.impl()->meta().cut = std::make_shared<const SequencePart>(
      SequencePart(group.ranks(), group.rank(), layout, dim, whole.dim()));
  return part;
}

namespace {

const SequencePart* sequence_part_of(const Tensor& t) {
  const AutogradMeta* meta = t.defined() ? t.impl()->autograd.get() : nullptr;
  return meta ? dynamic_cast<const SequencePart*>(meta->cut.get()) : nullptr;
}

// Without a record: do the positions of this rank's part run as `split`'s layout places its
// chunks (differences from the first position, row 0)? An empty string when they do.
std::string positions_mismatch(const Tensor& positions, const ContextSplit& split) {
  const Tensor row = positions.dim() == 2 ? positions.select(0, 0) : positions;
  const std::vector<int64_t> have = row.to(kCPU).to(kInt64).contiguous().to_vector<int64_t>();
  const int n = split.group.size();
  const std::vector<int64_t> mine = chunks_of(split.group.rank(), n, split.layout);
  const int64_t chunk = int64_t(have.size()) / int64_t(mine.size());
  for (size_t i = 0; i < have.size(); ++i) {
    const int64_t want = mine[i / size_t(chunk)] * chunk + int64_t(i) % chunk - mine[0] * chunk;
    if (have[i] - have[0] != want)
      return fmt::format(
          "its positions run {} ... at index {} (from the part's first) where the "
          "{} layout places {} of its {} positions",
          have[i] - have[0], i, layout_name(split.layout), want, have.size());
  }
  return {};
}

}  // namespace

void check_sequence_part(const Tensor& tokens, const Tensor& positions, const Tensor& document_ids,
                         const ContextSplit& split, const char* who) {
  const std::string expected =
      fmt::format("cut {} over group {}", layout_name(split.layout), split.group.str());
  const char* hint =
      "hint: cut the batch with ModelSplit::local_inputs, or parallel::shard_sequence(tokens, 1, "
      "group, layout) with the split's context group and layout (which record how they cut)";
  detail::check_together(
      [&] {
        WEAVE_CHECK(tokens.defined() && tokens.dim() >= 1, who,
                    "expected this rank's part of the tokens, found {}",
                    tokens.defined() ? fmt::format("{}", tokens.shape()) : "none");
        const SequencePart* part = sequence_part_of(tokens);
        if (!part) part = sequence_part_of(positions);
        if (part) {
          WEAVE_CHECK(part->group == split.group.ranks() && part->layout == split.layout &&
                          part->axis == part->dims - 1,
                      who, "the model's context split reads parts {}, but its input is {}; {}",
                      expected, part->describe(), hint);
          return;
        }
        WEAVE_CHECK(positions.defined() && !document_ids.defined(), who,
                    "this rank's part of the sequence carries no record of how it was cut and no "
                    "positions of the whole sequence tell it (the model reads parts {}); {}",
                    expected, hint);
        const std::string mismatch = positions_mismatch(positions, split);
        WEAVE_CHECK(mismatch.empty(), who, "the model's context split reads parts {}, but {}; {}",
                    expected, mismatch, hint);
      },
      split.group, who);
}

Tensor gather_sequence(const Tensor& part, int64_t axis, const dist::Group& group,
                       SequenceLayout layout) {
  const int64_t dim = normalize_dim(axis, part.dim(), "gather_sequence");
  // After the all_gather, which raises on every rank for parts of different shapes, every rank
  // holds the same length here and raises alike.
  Tensor whole = F::all_gather(part, dim, group);
  WEAVE_CHECK(layout != SequenceLayout::ZigZag || part.size(int(dim)) % 2 == 0, "gather_sequence",
              "the zig-zag layout holds two equal chunks per rank, but the parts hold {} "
              "positions; hint: shard_sequence makes parts of even length from a sequence that "
              "divides by twice the group size",
              part.size(int(dim)));
  return reorder(whole, dim, group.size(), layout, /*to_natural=*/true);
}

}  // namespace weave::parallel

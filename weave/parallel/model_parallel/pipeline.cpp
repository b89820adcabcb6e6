// Pipeline schedules: the order of micro-batch forwards and backwards on each stage; the
// point-to-point traffic is detail::StageLink's (pipeline_link.h).
#include "weave/parallel/model_parallel/pipeline.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <map>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/ops/side_loss.h"
#include "weave/parallel/core/agree.h"
#include "weave/parallel/model_parallel/pipeline_link.h"
#include "weave/tensor/tensor_impl.h"

namespace weave::parallel {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::vector<Tensor> microbatches_of(const Tensor& batch, int m, const char* what) {
  WEAVE_CHECK(batch.defined() && batch.dim() >= 1, "Pipeline",
              "the {} needs a batch dimension, found {}", what,
              batch.defined() ? fmt::format("shape {}", batch.shape()) : "an undefined tensor");
  WEAVE_CHECK(batch.size(0) % m == 0, "Pipeline",
              "the {} has batch size {}, which does not divide into {} micro-batches; hint: "
              "choose microbatches dividing the batch size",
              what, batch.size(0), m);
  std::vector<Tensor> micro = chunk(batch, m, 0);
  // Rows of a sequence part are parts cut the same way: the record (shard_sequence's) goes along.
  if (const AutogradMeta* meta = batch.impl()->autograd.get(); meta && meta->cut && batch.dim() > 1)
    for (Tensor& t : micro) t.impl()->meta().cut = meta->cut;
  return micro;
}

// A stage's data-parallel wrapper averages over ranks that hold the same stage: its group may
// share no rank but this one with the pipeline group.
void check_wrapper_group(const DataParallelWrapper& wrapper, const dist::Group& pipeline,
                         size_t chunk) {
  std::vector<int> shared;
  for (int r : wrapper.group().ranks())
    if (r != dist::rank() && pipeline.contains(r)) shared.push_back(r);
  WEAVE_CHECK(shared.empty(), "Pipeline",
              "the data-parallel wrapper of chunk {} averages over group {}, which shares ranks "
              "{} with the pipeline group {}: those hold other stages; hint: wrap each stage "
              "over the ranks holding the same stage (the mesh's data group)",
              chunk, wrapper.group().str(), fmt::join(shared, ", "), pipeline.str());
}

// A stage whose parameters a fully sharded wrapper trains through its own shards runs through
// that wrapper, which the pipeline must be given: driving the bare module would leave its
// micro-batches outside the wrapper's steps and its stage unrecorded on the shards.
void check_not_managed(nn::Module& chunk) {
  for (const auto& [name, p] : chunk.named_parameters()) {
    const AutogradMeta* meta = p.impl()->autograd.get();
    WEAVE_CHECK(meta == nullptr || meta->managed_by.empty(), "Pipeline",
                "stage parameter '{}' is managed by {}; a pipeline drives such a stage through "
                "its wrapper; hint: Pipeline(fsdp, options), the wrapper built over the ranks "
                "that hold the same stage (the mesh's data group)",
                name, meta->managed_by);
  }
}

}  // namespace

Schedule schedule_from_name(const std::string& name) {
  if (name == "gpipe") return Schedule::GPipe;
  if (name == "1f1b") return Schedule::OneFOneB;
  WEAVE_FAIL("Pipeline", "unknown schedule '{}'; expected gpipe or 1f1b", name);
}

Pipeline::Pipeline(nn::Module& stage, PipelineOptions options)
    : Pipeline(std::vector<nn::Module*>{&stage}, {nullptr}, options) {}

Pipeline::Pipeline(std::vector<nn::Module*> chunks, PipelineOptions options)
    : Pipeline(chunks, std::vector<DataParallelWrapper*>(chunks.size(), nullptr), options) {}

Pipeline::Pipeline(DataParallelWrapper& stage, PipelineOptions options)
    : Pipeline(std::vector<nn::Module*>{&stage.module()}, {&stage}, options) {}

Pipeline::Pipeline(std::vector<nn::Module*> chunks, std::vector<DataParallelWrapper*> wrappers,
                   PipelineOptions options)
    : chunks_(std::move(chunks)),
      wrappers_(std::move(wrappers)),
      options_(options),
      group_(options.group ? *options.group : dist::world()) {
  WEAVE_CHECK(group_.rank() >= 0, "Pipeline",
              "rank {} is not in the pipeline group {}; hint: pass the mesh's pipeline group",
              dist::rank(), group_.str());
  // Every stage learns of a bad argument on any stage, and the stages must agree on the
  // schedule: they raise together here rather than wait for each other's messages later.
  const int64_t m = options.microbatches, v = int64_t(chunks_.size()),
                schedule = static_cast<int64_t>(options.schedule);
  const detail::ValueRange agreed = detail::check_together(
      [&] {
        WEAVE_CHECK(options.microbatches >= 1, "Pipeline",
                    "microbatches must be at least 1, found {}", options.microbatches);
        WEAVE_CHECK(!chunks_.empty(), "Pipeline", "expected at least one chunk, found none");
        for (size_t c = 0; c < chunks_.size(); ++c) {
          WEAVE_CHECK(chunks_[c] != nullptr, "Pipeline", "a chunk is a null pointer");
          if (!wrappers_[c]) check_not_managed(*chunks_[c]);
        }
        for (size_t c = 0; c < wrappers_.size(); ++c)
          if (wrappers_[c]) check_wrapper_group(*wrappers_[c], group_, c);
        if (chunks_.size() > 1) {
          WEAVE_CHECK(stages() > 1, "Pipeline",
                      "{} virtual stages on a pipeline of one rank; hint: pass them as one "
                      "Sequential",
                      chunks_.size());
          WEAVE_CHECK(options.microbatches % stages() == 0, "Pipeline",
                      "interleaving {} virtual stages needs micro-batches in multiples of the {} "
                      "ranks, found {}",
                      chunks_.size(), stages(), options.microbatches);
        }
      },
      group_, "Pipeline", {m, v, schedule});
  const char* hint = "hint: every stage constructs its Pipeline with the same options";
  WEAVE_CHECK(agreed.same(0), "Pipeline",
              "the stages of group {} disagree on microbatches (from {} to {}; this stage: {}); {}",
              group_.str(), agreed.lowest[0], agreed.highest[0], m, hint);
  WEAVE_CHECK(agreed.same(1), "Pipeline",
              "the stages of group {} hold different numbers of chunks (from {} to {}; this "
              "stage: {}); {}",
              group_.str(), agreed.lowest[1], agreed.highest[1], v, hint);
  WEAVE_CHECK(agreed.same(2), "Pipeline", "the stages of group {} use different schedules; {}",
              group_.str(), hint);
  agree_on_seed();
  place_parameters();
}

namespace {

// The k-th forward of a rank: (micro-batch, chunk). Interleaved, micro-batches go in groups of
// p, each group through chunk 0, then chunk 1, ... (Megatron-LM's order); backwards visit the
// chunks in reverse.
std::pair<int, int> forward_unit(int k, int p, int v) {
  if (v == 1) return {k, 0};
  const int group = k / (p * v), within = k % (p * v);
  return {group * p + within % p, within / p};
}
std::pair<int, int> backward_unit(int k, int p, int v) {
  auto [micro, chunk] = forward_unit(k, p, v);
  return {micro, v - 1 - chunk};
}

// The interleaved schedule on a clock every stage keeps: at tick t, stage q runs forward unit
// t - q and backward unit t - q - lead(q) where they exist, then exchanges with both neighbours
// what each produced at that tick, as one grouped exchange. A tick's exchange pairs only with the
// neighbours' exchanges of the same tick, so the exchanges cannot wait on each other in a circle
// even where a send waits for its receive (NCCL), and what arrives at tick t is used at t + 1 or
// later. lead(q) = 2 (p - 1 - q) + base keeps each gradient a tick ahead of its use; base
// (v - 1) p is Megatron-LM's interleaved warm-up, base m v runs every forward first (GPipe).
// What a unit needs, taken out of the map it arrived in (an internal error if it never came).
template <typename Value>
Value take(std::map<std::pair<int, int>, Value>& arrived, std::pair<int, int> unit,
           const char* what) {
  auto node = arrived.extract(unit);
  WEAVE_CHECK(!node.empty(), "Pipeline", "internal: micro-batch {} of chunk {} has no {}",
              unit.first, unit.second, what);
  return std::move(node.mapped());
}

class Clock {
 public:
  Clock(int p, int v, int units, int base, bool backwards = true)
      : p_(p), v_(v), units_(units), base_(base), backwards_(backwards) {}
  int ticks() const { return backwards_ ? lead(0) + units_ : p_ - 1 + units_; }
  /// Stage q's forward (backward) unit at tick t, or -1.
  int forward_at(int q, int t) const { return in_range(t - q); }
  int backward_at(int q, int t) const { return backwards_ ? in_range(t - q - lead(q)) : -1; }
  /// Whether stage q sends an activation to the next stage (a gradient to the previous) at t.
  bool sends_forward(int q, int t) const {
    const int k = forward_at(q, t);
    return k >= 0 && !(q == p_ - 1 && forward_unit(k, p_, v_).second == v_ - 1);
  }
  bool sends_backward(int q, int t) const {
    const int k = backward_at(q, t);
    return k >= 0 && !(q == 0 && backward_unit(k, p_, v_).second == 0);
  }

 private:
  int lead(int q) const { return 2 * (p_ - 1 - q) + base_; }
  int in_range(int k) const { return k >= 0 && k < units_ ? k : -1; }
  int p_, v_, units_, base_;
  bool backwards_;
};

}  // namespace

void Pipeline::set_side_inputs(const nn::Inputs& inputs) {
  const int m = options_.microbatches;
  auto cut = [&](const Tensor& side, const char* what) -> std::vector<Tensor> {
    if (!side.defined()) return {};
    if (side.dim() < 2) return std::vector<Tensor>(size_t(m), side);  // [T]: every window's
    return microbatches_of(side, m, what);
  };
  positions_ = cut(inputs.positions, "positions");
  documents_ = cut(inputs.document_ids, "document ids");
}

Tensor Pipeline::train_step(const nn::Inputs& step_inputs, const Tensor& targets,
                            const PipelineLoss& loss) {
  const Tensor& inputs = step_inputs.x;
  const int m = options_.microbatches;
  std::vector<Tensor> in, target;
  // Every stage checks its own arguments and learns the others' verdict (and the batch sizes of
  // the first stage's inputs and the last stage's targets) before the first send.
  constexpr int64_t kNone = -1;  // below every batch size: the maxima are the stages' sizes
  auto batch_of = [&](const Tensor& t, bool mine) {
    return mine && t.defined() && t.dim() >= 1 ? t.size(0) : kNone;
  };
  const std::vector<int64_t> batch =
      detail::check_together(
          [&] {
            WEAVE_CHECK(
                autograd::must_run_pending() == 0, "Pipeline",
                "{} communicating autograd nodes from an earlier forward never ran backward, "
                "so peers may still wait for them; hint: finish that step's backward on "
                "every rank, or wrap forward-only passes in autograd::ForwardOnlyGuard",
                autograd::must_run_pending());
            if (is_first()) in = microbatches_of(inputs, m, "input");
            set_side_inputs(step_inputs);
            if (is_last()) {
              WEAVE_CHECK(static_cast<bool>(loss), "Pipeline",
                          "the last stage needs a loss function, found none");
              target = microbatches_of(targets, m, "target");
            }
          },
          group_, "Pipeline", {batch_of(inputs, is_first()), batch_of(targets, is_last())})
          .highest;
  WEAVE_CHECK(batch[0] == batch[1], "Pipeline",
              "the first stage's inputs have batch size {} but the last stage's targets {}; hint: "
              "pass the same batch's inputs and targets",
              batch[0], batch[1]);
  stats_ = {};
  Tensor mean_loss;
  Tensor side_losses;
  bool attached = false;
  {
    // Losses a stage attaches to its activations (its experts' balancing losses) are part of
    // the objective, each micro-batch's weighted as its loss is: 1 / m.
    SideLossScope side(1.0 / double(m));
    mean_loss =
        chunks_.size() == 1 ? train_linked(in, target, loss) : train_interleaved(in, target, loss);
    side_losses = side.total();
    attached = side.attached();
  }
  // Every stage's attached losses join the mean loss the last stage reports: reduced only where
  // a stage attached some (the agreement that raises on NaN tells).
  if (raise_if_any_stage_nonfinite(attached)) {
    dist::all_reduce(side_losses, dist::ReduceOp::Sum, group_);
    if (is_last())
      mean_loss = mean_loss + side_losses.reshape({}).to(mean_loss.dtype()).to(mean_loss.device());
  }
  sum_tied_gradients();
  return mean_loss;
}

namespace {

// Under a wrapper, micro-batch m - 1's forward is the step's synchronizing one, and its backward,
// the chunk's last, launches the wrapper's buckets: the others run under no_sync() and
// accumulate.
template <class Step>
auto quiet_unless_last(DataParallelWrapper* wrapper, bool last, const Step& step) {
  if (!wrapper || last) return step();
  NoSyncGuard quiet = wrapper->no_sync();
  return step();
}

}  // namespace

Tensor Pipeline::forward_chunk(int chunk, int micro, const Tensor& x) {
  DataParallelWrapper* wrapper = wrappers_[size_t(chunk)];
  const nn::Inputs in(x, positions_.empty() ? Tensor() : positions_[size_t(micro)],
                      documents_.empty() ? Tensor() : documents_[size_t(micro)]);
  return quiet_unless_last(wrapper, micro == options_.microbatches - 1, [&] {
    return wrapper ? wrapper->forward(in) : (*chunks_[size_t(chunk)])(in);
  });
}

void Pipeline::backward_chunk(int chunk, int micro, const Tensor& y,
                              const std::vector<Tensor>& grad_y) {
  if (!y.requires_grad()) return;
  DataParallelWrapper* wrapper = wrappers_[size_t(chunk)];
  const bool last = micro == options_.microbatches - 1;
  try {
    quiet_unless_last(wrapper, last, [&] {
      autograd::backward({y}, grad_y, /*retain_graph=*/false, /*run_must_run_nodes=*/false);
    });
  } catch (const Error& e) {
    // A wrapper that found NaN or infinity in its averaged gradients raised on every rank of
    // its group, with the backward done: the other stages still wait for this one's sends, so
    // the schedule goes on, and every stage raises at the end of the step (train_step).
    if (!wrapper || !last || wrapper->gradients_finite()) throw;
    if (nonfinite_.empty()) nonfinite_ = e.what();
  }
}

Tensor Pipeline::train_linked(const std::vector<Tensor>& in, const std::vector<Tensor>& target,
                              const PipelineLoss& loss) {
  const int m = options_.microbatches, p = stages(), s = stage();
  const double start = now_s();
  detail::StageLink link(group_, s, p);
  struct InFlight {
    Tensor x, y;  // the received input (a leaf) and the output: the loss on the last stage
  };
  std::deque<InFlight> live;
  Tensor total;
  int forwards = 0;
  auto forward = [&](const Tensor& received) {
    const int micro = forwards++;
    Tensor x = is_first() ? in[size_t(micro)] : received;
    Tensor y = forward_chunk(0, micro, x);
    if (is_last()) {
      y = loss(y, target[size_t(micro)]) / double(m);
      total = total.defined() ? total + y.detach() : y.detach();
    }
    live.push_back({x, y});
    stats_.peak_live_microbatches =
        std::max(stats_.peak_live_microbatches, static_cast<int>(live.size()));
    return y;
  };
  // The oldest micro-batch's backward from its output's gradient; returns its input's.
  int backwards = 0;
  auto backward = [&](const Tensor& grad_y) {
    const InFlight unit = live.front();
    live.pop_front();
    backward_chunk(0, backwards++, unit.y,
                   is_last() ? std::vector<Tensor>{} : std::vector<Tensor>{grad_y});
    if (is_first()) return Tensor();
    return unit.x.grad().defined() ? unit.x.grad() : zeros_like(unit.x);
  };
  auto receive = [&] { return is_first() ? Tensor() : link.recv_forward(); };
  auto forward_alone = [&] {
    const Tensor y = forward(receive());
    if (!is_last()) link.send_forward(y);
  };
  auto backward_alone = [&] {
    const Tensor grad_x = backward(is_last() ? Tensor() : link.recv_backward(live.front().y));
    if (!is_first()) link.send_backward(grad_x);
  };
  // GPipe: every forward, then every backward. 1F1B: p - s - 1 forwards, then one forward and
  // one backward at a time, each boundary's send paired with the receive from the same peer.
  const int warmup = options_.schedule == Schedule::GPipe ? m : std::min(p - s - 1, m);
  for (int k = 0; k < warmup; ++k) forward_alone();
  Tensor x = warmup < m ? receive() : Tensor();
  for (int k = warmup; k < m; ++k) {
    const Tensor y = forward(x);
    const Tensor grad_y = is_last() ? Tensor() : link.send_forward_recv_backward(y, live.front().y);
    const Tensor grad_x = backward(grad_y);
    if (is_first()) continue;
    if (k + 1 == m)
      link.send_backward(grad_x);
    else
      x = link.send_backward_recv_forward(grad_x);
  }
  while (!live.empty()) backward_alone();
  const double sends_start = now_s();
  dist::wait_sends(group_);
  stats_.waiting_s = link.waiting_s() + (now_s() - sends_start);
  stats_.step_s = now_s() - start;
  return total;
}

Tensor Pipeline::train_interleaved(const std::vector<Tensor>& in, const std::vector<Tensor>& target,
                                   const PipelineLoss& loss) {
  const int m = options_.microbatches, p = stages(), s = stage(), v = int(chunks_.size());
  const int units = m * v;
  const double start = now_s();
  const Clock clock(p, v, units, options_.schedule == Schedule::GPipe ? units : (v - 1) * p);
  detail::StageLink link(group_, s, p);
  Tensor total;
  struct InFlight {
    Tensor x, y;
  };
  using Unit = std::pair<int, int>;  // (micro-batch, chunk)
  std::map<Unit, InFlight> live;
  std::map<Unit, Tensor> inputs, grads;  // received a tick or more before their unit runs
  auto forward = [&](int k) {
    const auto [micro, chunk] = forward_unit(k, p, v);
    const Tensor x =
        is_first() && chunk == 0 ? in[size_t(micro)] : take(inputs, {micro, chunk}, "input");
    Tensor y = forward_chunk(chunk, micro, x);
    if (holds_last_stage(chunk)) {
      y = loss(y, target[size_t(micro)]) / double(m);
      total = total.defined() ? total + y.detach() : y.detach();
    }
    live[{micro, chunk}] = {x, y};
    stats_.peak_live_microbatches =
        std::max(stats_.peak_live_microbatches, static_cast<int>(live.size()));
    return holds_last_stage(chunk) ? Tensor() : y;  // what goes to the next stage
  };
  auto backward = [&](int k) {
    const auto [micro, chunk] = backward_unit(k, p, v);
    const InFlight unit = take(live, {micro, chunk}, "forward");
    std::vector<Tensor> grad_y;  // none for the loss
    if (!holds_last_stage(chunk)) grad_y.push_back(take(grads, {micro, chunk}, "gradient"));
    backward_chunk(chunk, micro, unit.y, grad_y);
    if (is_first() && chunk == 0) return Tensor();  // what goes to the previous stage
    return unit.x.grad().defined() ? unit.x.grad() : zeros_like(unit.x);
  };
  const int previous = link.previous(), next = link.next();
  for (int t = 0; t < clock.ticks(); ++t) {
    const int f = clock.forward_at(s, t), b = clock.backward_at(s, t);
    const Tensor y = f >= 0 ? forward(f) : Tensor();
    const Tensor grad_x = b >= 0 ? backward(b) : Tensor();
    const bool from_previous = clock.sends_forward(previous, t),
               from_next = clock.sends_backward(next, t);
    auto [x, grad] = link.step(y, grad_x, from_previous, from_next);
    // The previous rank's unit (micro, c) feeds this rank's (micro, c), or (micro, c + 1) where
    // the last rank feeds the first; gradients go the other way.
    if (from_previous) {
      const auto [micro, chunk] = forward_unit(clock.forward_at(previous, t), p, v);
      inputs[{micro, s == 0 ? chunk + 1 : chunk}] = x;
    }
    if (from_next) {
      const auto [micro, chunk] = backward_unit(clock.backward_at(next, t), p, v);
      grads[{micro, s == p - 1 ? chunk - 1 : chunk}] = grad;
    }
  }
  stats_.waiting_s = link.waiting_s();
  stats_.step_s = now_s() - start;
  return total;
}

namespace {

// The micro-batches' outputs along `dim`; outputs of k times their micro-batch's rows (every
// batch rank's rows, rank by rank) block by block, so that rank j's rows stand together.
Tensor join_outputs(const std::vector<Tensor>& outputs, const std::vector<int64_t>& rows, int dim) {
  const int64_t first = outputs.empty() || rows[0] == 0 ? 0 : outputs[0].size(dim) / rows[0];
  bool blocks = first > 1;
  for (size_t i = 0; i < outputs.size() && blocks; ++i)
    blocks = outputs[i].size(dim) == first * rows[i];
  if (!blocks) return cat(outputs, dim);
  std::vector<Tensor> parts;
  for (int64_t j = 0; j < first; ++j)
    for (size_t i = 0; i < outputs.size(); ++i)
      parts.push_back(outputs[i].narrow(dim, j * rows[i], rows[i]));
  return cat(parts, dim);
}

}  // namespace

Tensor Pipeline::predict(const nn::Inputs& inputs, int output_batch_dim) {
  NoGradGuard no_grad;
  const int m = options_.microbatches, p = stages(), s = stage(), v = int(chunks_.size());
  std::vector<Tensor> in;
  if (is_first()) in = microbatches_of(inputs.x, m, "input");
  set_side_inputs(inputs);
  const Clock clock(p, v, m * v, 0, /*backwards=*/false);
  detail::StageLink link(group_, s, p);
  std::map<std::pair<int, int>, Tensor> received;
  std::vector<Tensor> outputs;
  std::vector<int64_t> rows;  // each output's micro-batch rows
  const int previous = link.previous();
  for (int t = 0; t < clock.ticks(); ++t) {
    Tensor to_next;
    if (const int f = clock.forward_at(s, t); f >= 0) {
      const auto [micro, chunk] = forward_unit(f, p, v);
      const Tensor x =
          is_first() && chunk == 0 ? in[size_t(micro)] : take(received, {micro, chunk}, "input");
      Tensor y = (*chunks_[size_t(chunk)])(
          nn::Inputs(x, positions_.empty() ? Tensor() : positions_[size_t(micro)],
                     documents_.empty() ? Tensor() : documents_[size_t(micro)]));
      if (holds_last_stage(chunk)) rows.push_back(x.size(0));
      (holds_last_stage(chunk) ? outputs.emplace_back() : to_next) = y;
    }
    const bool from_previous = clock.sends_forward(previous, t);
    const Tensor x = link.step(to_next, Tensor(), from_previous, false).first;
    if (from_previous) {
      const auto [micro, chunk] = forward_unit(clock.forward_at(previous, t), p, v);
      received[{micro, s == 0 ? chunk + 1 : chunk}] = x;
    }
  }
  return is_last() ? join_outputs(outputs, rows, output_batch_dim) : Tensor();
}

}  // namespace weave::parallel

#include "weave/autograd/engine.h"

#include "weave/tensor/trace.h"

#include <cstdio>
#include <queue>
#include <unordered_map>
#include <utility>

#include "weave/autograd/grad_mode.h"
#include "weave/autograd/node.h"
#include "weave/kernels/kernels.h"

namespace weave::autograd {

namespace {

thread_local std::string running_node_name;
thread_local int backward_depth = 0;
// A queue_callback callback (on_success) or a queue_final_callback one (always).
struct Callback {
  std::function<void()> on_success;
  std::function<void(bool)> always;
};
thread_local std::vector<Callback> pending_callbacks;
// Held strongly: a rank may drop a collective's token, but its peers still need its backward.
// `era` is the number of backward passes this thread had finished when the node was marked.
// `id` counts marks on this thread (ForwardOnlyGuard drops the ids from its start on).
struct MustRun {
  std::shared_ptr<Node> node;
  uint64_t era;
  uint64_t id;
};
thread_local std::vector<MustRun> must_run_nodes;
thread_local uint64_t backward_era = 0, next_must_run_id = 0;
thread_local bool warned_stale = false, warned_growth = false;
// Marked nodes beyond which a forward that is never backpropagated is the likely cause.
constexpr size_t kMustRunWarnCount = 100000;

void warn_once(bool& warned, const std::string& message) {
  if (warned) return;
  warned = true;
  std::fprintf(stderr, "[weave] warning: %s\n", message.c_str());
}

Tensor filled(const TensorMeta& meta, double value) {
  Tensor t = empty(meta.shape, {.dtype = meta.dtype, .device = meta.device});
  kernels::fill(t, value);
  return t;
}

void accumulate(Tensor& slot, Tensor grad) {
  if (!slot.defined()) {
    slot = std::move(grad);
    return;
  }
  // The slot may alias a tensor someone else holds (an expanded view, a user's grad), so the
  // sum goes to a fresh buffer.
  Tensor sum = empty(slot.shape(), {.dtype = slot.dtype(), .device = slot.device()});
  kernels::binary(kernels::BinaryOp::Add, slot, grad, sum);
  slot = std::move(sum);
}

struct ReadyEntry {
  Node* node;
  uint64_t sequence_nr;
  uint64_t arrival;
  bool operator<(const ReadyEntry& other) const {  // max-heap: highest sequence, then earliest
    if (sequence_nr != other.sequence_nr) return sequence_nr < other.sequence_nr;
    return arrival > other.arrival;
  }
};

struct DepthGuard {
  DepthGuard() { ++backward_depth; }
  ~DepthGuard() {
    if (--backward_depth == 0) {
      pending_callbacks.clear();
      running_node_name.clear();
    }
  }
};

void check_gradient(const Node& node, size_t index, const Tensor& grad, const TensorMeta& meta) {
  WEAVE_CHECK(grad.shape() == meta.shape, "autograd",
              "{} returned a gradient of shape {} for input {}, expected shape {}", node.name(),
              grad.shape(), index, meta.shape);
  WEAVE_CHECK(grad.device() == meta.device, "autograd",
              "{} returned a gradient on {} for input {}, expected {}", node.name(), grad.device(),
              index, meta.device);
}

}  // namespace

const std::string& current_node_name() {
  return running_node_name;
}

void must_run(std::shared_ptr<Node> node) {
  must_run_nodes.push_back({std::move(node), backward_era, next_must_run_id++});
  if (must_run_nodes.size() == kMustRunWarnCount)
    warn_once(warned_growth,
              fmt::format("{} must-run nodes (differentiable collectives, say) are waiting for a "
                          "backward on this thread; a "
                          "forward with grad mode on that is never backpropagated (evaluation) "
                          "keeps its graph until the next backward replays it; hint: run "
                          "evaluation under NoGradGuard or autograd::ForwardOnlyGuard",
                          kMustRunWarnCount));
}
size_t must_run_pending() {
  return must_run_nodes.size();
}
void clear_must_run() {
  must_run_nodes.clear();
}

ForwardOnlyGuard::ForwardOnlyGuard() : first_(next_must_run_id) {}
ForwardOnlyGuard::~ForwardOnlyGuard() {
  std::erase_if(must_run_nodes, [this](const MustRun& m) { return m.id >= first_; });
}

bool in_backward() {
  return backward_depth > 0;
}

namespace {
thread_local int recompute_depth = 0;
}

detail::RecomputeGuard::RecomputeGuard() : depth_(std::exchange(backward_depth, 0)) {
  ++recompute_depth;
}
detail::RecomputeGuard::~RecomputeGuard() {
  backward_depth = depth_;
  --recompute_depth;
}

bool detail::recomputing() {
  return recompute_depth > 0;
}

void queue_callback(std::function<void()> fn) {
  WEAVE_CHECK(backward_depth > 0, "queue_callback",
              "no backward pass is running on this thread; hint: call it from a hook");
  pending_callbacks.push_back({std::move(fn), nullptr});
}

void queue_final_callback(std::function<void(bool failed)> fn) {
  WEAVE_CHECK(backward_depth > 0, "queue_final_callback",
              "no backward pass is running on this thread; hint: call it from a hook");
  pending_callbacks.push_back({nullptr, std::move(fn)});
}

namespace {

// Backward unwinds: every final callback still learns that it failed (the first error is the
// one that propagates; theirs are dropped).
void run_failed_callbacks(size_t from) {
  for (size_t i = from; i < pending_callbacks.size(); ++i) {
    auto always = std::move(pending_callbacks[i].always);
    if (!always) continue;
    try {
      always(true);
    } catch (...) {
    }
  }
}

}  // namespace

void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads, bool retain_graph,
              bool run_must_run_nodes) {
  WEAVE_CHECK(grads.empty() || grads.size() == roots.size(), "backward",
              "expected one gradient per root ({}), found {}", roots.size(), grads.size());
  NoGradGuard no_grad;
  DepthGuard depth;

  // Seed the input buffers of the root nodes.
  std::unordered_map<Node*, std::vector<Tensor>> buffers;
  std::vector<std::shared_ptr<Node>> root_nodes;
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& root = roots[i];
    WEAVE_CHECK(root.defined(), "backward", "root {} is an undefined tensor", i);
    WEAVE_CHECK(root.requires_grad(), "backward",
                "root {} (shape {}) does not require grad and has no grad_fn; hint: did you "
                "compute it under NoGradGuard or from tensors without requires_grad?",
                i, root.shape());
    Tensor grad = i < grads.size() ? grads[i] : Tensor();
    if (!grad.defined()) {
      WEAVE_CHECK(root.numel() <= 1, "backward",
                  "a gradient can be implied only for one-element roots, found shape {}; hint: "
                  "pass the gradient explicitly",
                  root.shape());
      grad = filled({root.shape(), root.dtype(), root.device()}, root.numel() == 1 ? 1.0 : 0.0);
    }
    WEAVE_CHECK(grad.shape() == root.shape(), "backward",
                "gradient shape {} does not match root shape {}", grad.shape(), root.shape());
    if (grad.dtype() != root.dtype() || grad.device() != root.device()) {
      Tensor converted = empty(root.shape(), {.dtype = root.dtype(), .device = root.device()});
      kernels::copy(grad, converted);
      grad = converted;
    }
    Edge edge = gradient_edge(root);
    auto& buffer = buffers[edge.function.get()];
    buffer.resize(std::max<size_t>(edge.function->output_meta().size(), 1));
    accumulate(buffer[edge.input_nr], grad);
    root_nodes.push_back(edge.function);
  }

  if (run_must_run_nodes) {
    size_t stale = 0;
    for (auto& entry : must_run_nodes) {
      root_nodes.push_back(entry.node);
      stale += entry.era < backward_era;
    }
    if (stale > 0)
      warn_once(
          warned_stale,
          fmt::format(
              "this backward also runs {} must-run node(s) marked before an "
              "earlier backward that did not run them (a forward never "
              "backpropagated, or a schedule that turned run_must_run_nodes off); "
              "they run now (a collective's communication is replayed); hint: wrap evaluation "
              "forwards in NoGradGuard or autograd::ForwardOnlyGuard",
              stale));
  }

  // Count, for every reachable node, how many reachable edges point at it.
  std::unordered_map<Node*, int> dependencies;
  {
    std::vector<Node*> stack;
    std::unordered_map<Node*, bool> seen;
    for (auto& node : root_nodes)
      if (!seen[node.get()]) {
        seen[node.get()] = true;
        stack.push_back(node.get());
      }
    while (!stack.empty()) {
      Node* node = stack.back();
      stack.pop_back();
      for (const Edge& edge : node->next_edges()) {
        if (!edge.is_valid()) continue;
        Node* next = edge.function.get();
        ++dependencies[next];
        if (!seen[next]) {
          seen[next] = true;
          stack.push_back(next);
        }
      }
    }
  }

  std::priority_queue<ReadyEntry> ready;
  uint64_t arrivals = 0;
  {
    std::unordered_map<Node*, bool> queued;
    for (auto& node : root_nodes)
      if (dependencies[node.get()] == 0 && !queued[node.get()]) {
        queued[node.get()] = true;
        ready.push({node.get(), node->sequence_nr(), arrivals++});
      }
  }

  // Keeps nodes alive while they run even if the last tensor holding them goes away.
  std::vector<std::shared_ptr<Node>> keep_alive(root_nodes);
  std::unordered_map<Node*, bool> executed;
  auto forget_executed = [&] {
    std::erase_if(must_run_nodes,
                  [&](const MustRun& m) { return executed.count(m.node.get()) > 0; });
  };
  try {
    while (!ready.empty()) {
      Node* node = ready.top().node;
      ready.pop();
      executed[node] = true;
      std::vector<Tensor> inputs = std::move(buffers[node]);
      buffers.erase(node);
      const auto& meta = node->output_meta();
      inputs.resize(std::max<size_t>(meta.size(), 1));
      for (size_t i = 0; i < meta.size(); ++i)
        if (!inputs[i].defined()) inputs[i] = filled(meta[i], 0.0);
      for (auto& pre_hook : node->pre_hooks()) {
        Tensor replaced = pre_hook.hook(inputs[pre_hook.output_nr]);
        if (replaced.defined()) inputs[pre_hook.output_nr] = replaced;
      }

      running_node_name = node->name();
      std::vector<Tensor> outputs;
      {
        const trace::Scope trace_scope("backward", trace::enabled() ? node->name() : std::string());
        outputs = node->apply(std::move(inputs));
      }
      if (!retain_graph) node->release_variables();

      const auto& edges = node->next_edges();
      WEAVE_CHECK(outputs.size() == edges.size() || edges.empty(), "autograd",
                  "{} returned {} gradients, expected {}", node->name(), outputs.size(),
                  edges.size());
      for (size_t i = 0; i < edges.size(); ++i) {
        const Edge& edge = edges[i];
        if (!edge.is_valid()) continue;
        Node* next = edge.function.get();
        if (outputs[i].defined()) {
          check_gradient(*node, i, outputs[i], next->output_meta()[edge.input_nr]);
          auto& buffer = buffers[next];
          buffer.resize(std::max<size_t>(next->output_meta().size(), 1));
          accumulate(buffer[edge.input_nr], std::move(outputs[i]));
        }
        if (--dependencies[next] == 0) {
          keep_alive.push_back(edge.function);
          ready.push({next, next->sequence_nr(), arrivals++});
        }
      }
    }
  } catch (...) {
    forget_executed();  // the nodes that ran did communicate; the rest stay pending
    run_failed_callbacks(0);
    throw;
  }
  running_node_name.clear();
  forget_executed();
  ++backward_era;

  // Callbacks may queue further callbacks; run until none are left. One that raises ends the
  // pass: the final callbacks after it run as failed, then its error propagates.
  for (size_t i = 0; i < pending_callbacks.size(); ++i) {
    Callback callback = std::move(pending_callbacks[i]);
    try {
      if (callback.on_success)
        callback.on_success();
      else
        callback.always(false);
    } catch (...) {
      run_failed_callbacks(i + 1);
      throw;
    }
  }
}

}  // namespace weave::autograd

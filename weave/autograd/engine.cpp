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
uint64_t must_run_marked() {
  return next_must_run_id;
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

namespace {

Tensor root_gradient(const Tensor& root, size_t index, Tensor grad) {
  WEAVE_CHECK(root.defined(), "backward", "root {} is an undefined tensor", index);
  WEAVE_CHECK(root.requires_grad(), "backward",
              "root {} (shape {}) does not require grad and has no grad_fn; hint: did you "
              "compute it under NoGradGuard or from tensors without requires_grad?",
              index, root.shape());
  if (!grad.defined()) {
    WEAVE_CHECK(root.numel() <= 1, "backward",
                "a gradient can be implied only for one-element roots, found shape {}; hint: "
                "pass the gradient explicitly",
                root.shape());
    return filled({root.shape(), root.dtype(), root.device()}, root.numel() == 1 ? 1.0 : 0.0);
  }
  WEAVE_CHECK(grad.shape() == root.shape(), "backward",
              "gradient shape {} does not match root shape {}", grad.shape(), root.shape());
  if (grad.dtype() == root.dtype() && grad.device() == root.device()) return grad;
  Tensor converted = empty(root.shape(), {.dtype = root.dtype(), .device = root.device()});
  kernels::copy(grad, converted);
  return converted;
}

// One backward pass over the graph reachable from its roots: seed the roots' gradients, count
// each node's dependencies (reachable edges pointing at it), then run the ready nodes, highest
// sequence number first (the reverse of the forward order where the graph leaves a choice).
class GraphTask {
 public:
  explicit GraphTask(bool retain_graph) : retain_graph_(retain_graph) {}

  void seed_roots(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads) {
    for (size_t i = 0; i < roots.size(); ++i) {
      Tensor grad = root_gradient(roots[i], i, i < grads.size() ? grads[i] : Tensor());
      Edge edge = gradient_edge(roots[i]);
      add_input(edge, std::move(grad));
      roots_.push_back(edge.function);
    }
  }

  // The nodes marked must-run on this thread (collectives whose peers wait for their backward)
  // become roots too.
  void add_must_run_nodes() {
    size_t stale = 0;
    for (auto& entry : must_run_nodes) {
      roots_.push_back(entry.node);
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

  void count_dependencies() {
    std::vector<Node*> stack;
    for (auto& root : roots_)
      if (!std::exchange(nodes_[root.get()].seen, true)) stack.push_back(root.get());
    while (!stack.empty()) {
      Node* node = stack.back();
      stack.pop_back();
      for (const Edge& edge : node->next_edges()) {
        if (!edge.is_valid()) continue;
        NodeState& next = nodes_[edge.function.get()];
        ++next.dependencies;
        if (!std::exchange(next.seen, true)) stack.push_back(edge.function.get());
      }
    }
  }

  // On failure the nodes that ran have communicated and leave the must-run list; the rest stay.
  void run_ready_nodes() {
    keep_alive_ = roots_;
    for (auto& root : roots_)
      if (nodes_[root.get()].dependencies == 0) push_ready(root);
    try {
      while (!ready_.empty()) {
        Node* node = ready_.top().node;
        ready_.pop();
        run_node(*node);
      }
    } catch (...) {
      forget_executed_must_run_nodes();
      throw;
    }
    forget_executed_must_run_nodes();
  }

 private:
  struct NodeState {
    std::vector<Tensor> inputs;  // the gradients arrived so far, one per forward output
    int dependencies = 0;        // edges from nodes that have not run yet
    bool seen = false, queued = false, executed = false;
  };
  struct ReadyEntry {
    Node* node;
    uint64_t sequence_nr;
    uint64_t arrival;
    bool operator<(const ReadyEntry& other) const {  // max-heap: highest sequence, then earliest
      if (sequence_nr != other.sequence_nr) return sequence_nr < other.sequence_nr;
      return arrival > other.arrival;
    }
  };

  void add_input(const Edge& edge, Tensor grad) {
    auto& inputs = nodes_[edge.function.get()].inputs;
    inputs.resize(std::max<size_t>(edge.function->output_meta().size(), 1));
    accumulate(inputs[edge.input_nr], std::move(grad));
  }

  void push_ready(const std::shared_ptr<Node>& node) {
    if (std::exchange(nodes_[node.get()].queued, true)) return;
    keep_alive_.push_back(node);
    ready_.push({node.get(), node->sequence_nr(), arrivals_++});
  }

  // The node's gradients, with zeros for the outputs no gradient reached, after its pre-hooks.
  std::vector<Tensor> take_inputs(Node& node, NodeState& state) {
    std::vector<Tensor> inputs = std::move(state.inputs);
    const auto& meta = node.output_meta();
    inputs.resize(std::max<size_t>(meta.size(), 1));
    for (size_t i = 0; i < meta.size(); ++i)
      if (!inputs[i].defined()) inputs[i] = filled(meta[i], 0.0);
    for (auto& pre_hook : node.pre_hooks()) {
      Tensor replaced = pre_hook.hook(inputs[pre_hook.output_nr]);
      if (replaced.defined()) inputs[pre_hook.output_nr] = replaced;
    }
    return inputs;
  }

  void run_node(Node& node) {
    NodeState& state = nodes_[&node];
    state.executed = true;
    std::vector<Tensor> inputs = take_inputs(node, state);
    running_node_name = node.name();
    std::vector<Tensor> outputs;
    {
      const trace::Scope trace_scope("backward", trace::enabled() ? node.name() : std::string());
      outputs = node.apply(std::move(inputs));
    }
    if (!retain_graph_) node.release_variables();

    const auto& edges = node.next_edges();
    WEAVE_CHECK(outputs.size() == edges.size() || edges.empty(), "autograd",
                "{} returned {} gradients, expected {}", node.name(), outputs.size(), edges.size());
    for (size_t i = 0; i < edges.size(); ++i) {
      const Edge& edge = edges[i];
      if (!edge.is_valid()) continue;
      if (outputs[i].defined()) {
        check_gradient(node, i, outputs[i], edge.function->output_meta()[edge.input_nr]);
        add_input(edge, std::move(outputs[i]));
      }
      if (--nodes_[edge.function.get()].dependencies == 0) push_ready(edge.function);
    }
  }

  void forget_executed_must_run_nodes() {
    std::erase_if(must_run_nodes, [&](const MustRun& m) {
      auto it = nodes_.find(m.node.get());
      return it != nodes_.end() && it->second.executed;
    });
  }

  bool retain_graph_;
  // References into an unordered_map stay valid as it grows.
  std::unordered_map<Node*, NodeState> nodes_;
  std::vector<std::shared_ptr<Node>> roots_;
  // Keeps queued nodes alive while they wait and run, even if the last tensor holding them goes.
  std::vector<std::shared_ptr<Node>> keep_alive_;
  std::priority_queue<ReadyEntry> ready_;
  uint64_t arrivals_ = 0;
};

// Callbacks may queue further callbacks; run until none are left. One that raises ends the
// pass: the final callbacks after it run as failed, then its error propagates.
void run_callbacks() {
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

}  // namespace

void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads, bool retain_graph,
              bool run_must_run_nodes) {
  WEAVE_CHECK(grads.empty() || grads.size() == roots.size(), "backward",
              "expected one gradient per root ({}), found {}", roots.size(), grads.size());
  NoGradGuard no_grad;
  DepthGuard depth;
  GraphTask task(retain_graph);
  task.seed_roots(roots, grads);
  if (run_must_run_nodes) task.add_must_run_nodes();
  task.count_dependencies();
  try {
    task.run_ready_nodes();
  } catch (...) {
    run_failed_callbacks(0);
    throw;
  }
  running_node_name.clear();
  ++backward_era;
  run_callbacks();
}

}  // namespace weave::autograd

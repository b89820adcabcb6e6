#include "weave/autograd/node.h"

#include <utility>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/kernels/kernels.h"
#include "weave/tensor/tensor_impl.h"

namespace weave::autograd {

namespace {
thread_local bool grad_mode_enabled = true;
thread_local uint64_t sequence_counter = 0;
std::atomic<uint64_t> hook_counter{1};
}  // namespace

bool GradMode::is_enabled() {
  return grad_mode_enabled;
}
void GradMode::set_enabled(bool enabled) {
  grad_mode_enabled = enabled;
}

uint64_t next_sequence_nr() {
  return sequence_counter++;
}
uint64_t next_hook_id() {
  return hook_counter++;
}

Node::Node(uint64_t sequence_nr) : sequence_nr_(sequence_nr) {}
Node::Node() : sequence_nr_(next_sequence_nr()) {}

uint32_t Node::add_output(const Tensor& output) {
  output_meta_.push_back({output.shape(), output.dtype(), output.device()});
  return static_cast<uint32_t>(output_meta_.size() - 1);
}

// ---- AccumulateGrad ---------------------------------------------------------------------

namespace {
/// `grad` itself when nobody else can see its memory, else a copy: later gradients are added
/// into it in place. A backward's result is often a view of its own fresh buffer (a reshape),
/// which counts as unshared when that buffer's handle is held by the view alone and the view
/// covers all of it; the view then becomes a plain tensor, so no base outlives it.
Tensor take_if_unshared(Tensor grad) {
  const auto& impl = grad.impl_ptr();
  if (impl.use_count() != 1 || !grad.is_contiguous()) return grad.clone();
  if (!impl->view_base) return grad.storage().use_count() == 1 ? grad : grad.clone();
  const bool whole =
      grad.offset() == 0 && grad.numel() * grad.itemsize() == grad.storage()->nbytes();
  if (!whole || impl->view_base.use_count() != 1 || grad.storage().use_count() != 2)
    return grad.clone();
  impl->view_base.reset();
  return grad;
}
}  // namespace

AccumulateGrad::AccumulateGrad(const Tensor& leaf)
    : Node(std::numeric_limits<uint64_t>::max()), variable_(leaf.impl_ptr()) {
  add_output(leaf);
}

Tensor AccumulateGrad::variable() const {
  return Tensor(variable_.lock());
}

std::vector<Tensor> AccumulateGrad::apply(std::vector<Tensor>&& grads) {
  Tensor leaf = variable();
  if (!leaf.defined()) return {};
  AutogradMeta& meta = leaf.impl()->meta();
  Tensor grad = std::move(grads[0]);
  for (auto& [id, hook] : meta.leaf_hooks) {
    Tensor replaced = hook(grad);
    if (replaced.defined()) grad = replaced;
  }
  if (!meta.grad.defined()) {
    meta.grad = take_if_unshared(std::move(grad));
  } else {
    kernels::binary(kernels::BinaryOp::Add, meta.grad, grad, meta.grad);
    meta.grad.storage()->bump_version();
  }
  for (auto& [id, hook] : meta.post_accumulate_hooks) hook(leaf);
  return {};
}

// ---- SavedTensor ------------------------------------------------------------------------

namespace {
thread_local std::shared_ptr<detail::SavedTensorHooks> saved_tensor_hooks;
}  // namespace

detail::SavedTensorHooksGuard::SavedTensorHooksGuard(std::shared_ptr<SavedTensorHooks> hooks)
    : previous_(std::exchange(saved_tensor_hooks, std::move(hooks))) {}
detail::SavedTensorHooksGuard::~SavedTensorHooksGuard() {
  saved_tensor_hooks = std::move(previous_);
}

SavedTensor::SavedTensor(const Tensor& tensor) {
  if (!tensor.defined()) return;
  if (saved_tensor_hooks) {
    slot_ = saved_tensor_hooks->pack(tensor);
    if (slot_ >= 0) {
      hooks_ = saved_tensor_hooks;
      return;
    }
  }
  // Not make_view: a view keeps its base handle (view_base), and the base may be the very
  // output whose node owns this SavedTensor.
  auto alias = std::make_shared<TensorImpl>();
  alias->storage = tensor.storage();
  alias->shape = tensor.shape();
  alias->strides = tensor.strides();
  alias->offset = tensor.offset();
  alias->dtype = tensor.dtype();
  tensor_ = Tensor(std::move(alias));
  saved_version_ = tensor.version();
}

Tensor SavedTensor::unpack() const {
  if (slot_ >= 0) return hooks_->unpack(slot_);
  if (tensor_.defined() && tensor_.version() != saved_version_) {
    WEAVE_FAIL("autograd",
               "a tensor of shape {} saved by {} was modified in place: saved at version {}, now "
               "at version {}; hint: clone() it before the in-place op, or use an out-of-place op",
               tensor_.shape(), current_node_name(), saved_version_, tensor_.version());
  }
  return tensor_;
}

// ---- FunctionNode and recording ---------------------------------------------------------

std::vector<Tensor> FunctionNode::apply(std::vector<Tensor>&& grads) {
  WEAVE_CHECK(backward_ != nullptr, "autograd",
              "trying to backward through {} a second time, but its saved tensors were freed; "
              "hint: pass retain_graph=true to the first backward",
              name_);
  return backward_(BackwardArgs{grads, *this});
}

namespace {
std::shared_ptr<Node> grad_accumulator(const Tensor& leaf) {
  AutogradMeta& meta = leaf.impl()->meta();
  if (auto existing = meta.grad_accumulator.lock()) return existing;
  auto node = std::make_shared<AccumulateGrad>(leaf);
  meta.grad_accumulator = node;
  return node;
}
}  // namespace

Edge gradient_edge(const Tensor& tensor) {
  if (!tensor.defined()) return {};
  if (tensor.grad_fn()) return {tensor.grad_fn(), tensor.output_nr()};
  if (tensor.requires_grad()) return {grad_accumulator(tensor), 0};
  return {};
}

bool should_record(std::initializer_list<Tensor> inputs) {
  if (!GradMode::is_enabled()) return false;
  for (const Tensor& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

bool should_record(const std::vector<Tensor>& inputs) {
  if (!GradMode::is_enabled()) return false;
  for (const Tensor& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

void attach(const std::shared_ptr<Node>& node, const std::vector<Tensor>& inputs,
            const std::vector<Tensor>& outputs) {
  auto& edges = node->mutable_next_edges();
  edges.reserve(inputs.size());
  for (const Tensor& input : inputs) edges.push_back(gradient_edge(input));
  for (const Tensor& output : outputs) {
    if (!output.defined()) continue;
    AutogradMeta& meta = output.impl()->meta();
    meta.requires_grad = true;
    meta.grad_fn = node;
    meta.output_nr = node->add_output(output);
  }
}

namespace detail {
bool grad_mode_enabled() {
  return GradMode::is_enabled();
}
void attach_must_run(const std::shared_ptr<Node>& node, const std::vector<Tensor>& inputs,
                     const std::vector<Tensor>& outputs) {
  attach(node, inputs, outputs);
  must_run(node);
}
}  // namespace detail

}  // namespace weave::autograd

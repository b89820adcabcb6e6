// Tensor's autograd methods.
#include "weave/autograd/engine.h"
#include "weave/autograd/node.h"
#include "weave/kernels/kernels.h"
#include "weave/tensor/tensor_impl.h"

namespace weave {

namespace {
const std::shared_ptr<autograd::Node> kNoNode;
}

bool Tensor::requires_grad() const {
  if (!defined()) return false;
  const auto& meta = impl()->autograd;
  return meta && (meta->requires_grad || meta->grad_fn);
}

Tensor& Tensor::requires_grad_(bool enabled) {
  WEAVE_CHECK(defined(), "requires_grad_", "undefined tensor");
  WEAVE_CHECK(is_leaf(), "requires_grad_",
              "only leaves can change requires_grad; this tensor comes from {}; hint: detach() "
              "it first",
              grad_fn()->name());
  WEAVE_CHECK(!enabled || is_floating(dtype()), "requires_grad_",
              "only floating tensors can require grad, found {}", dtype());
  impl()->meta().requires_grad = enabled;
  return *this;
}

Tensor Tensor::grad() const {
  WEAVE_CHECK(defined(), "grad",
              "undefined tensor; hint: a default-constructed Tensor has no data");
  const auto& meta = impl()->autograd;
  return meta ? meta->grad : Tensor();
}

void Tensor::set_grad(const Tensor& grad) const {
  WEAVE_CHECK(defined(), "set_grad", "undefined tensor");
  if (grad.defined())
    WEAVE_CHECK(grad.shape() == shape(), "set_grad",
                "gradient shape {} differs from tensor shape {}", grad.shape(), shape());
  impl()->meta().grad = grad;
}

const std::shared_ptr<autograd::Node>& Tensor::grad_fn() const {
  if (!defined()) return kNoNode;
  const auto& meta = impl()->autograd;
  return meta ? meta->grad_fn : kNoNode;
}

bool Tensor::is_leaf() const {
  WEAVE_CHECK(defined(), "is_leaf",
              "undefined tensor; hint: a default-constructed Tensor has no data");
  return grad_fn() == nullptr;
}

uint32_t Tensor::output_nr() const {
  if (!defined()) return 0;
  const auto& meta = impl()->autograd;
  return meta ? meta->output_nr : 0;
}

void Tensor::backward(const Tensor& grad, bool retain_graph) const {
  autograd::backward({*this}, {grad}, retain_graph);
}

HookHandle Tensor::register_hook(GradHook hook) const {
  WEAVE_CHECK(requires_grad(), "register_hook",
              "the tensor (shape {}) does not require grad, so no gradient will reach the hook",
              shape());
  const uint64_t id = autograd::next_hook_id();
  if (is_leaf()) {
    impl()->meta().leaf_hooks.emplace_back(id, std::move(hook));
    std::weak_ptr<TensorImpl> weak = impl_ptr();
    return HookHandle([weak, id] {
      if (auto impl = weak.lock())
        std::erase_if(impl->meta().leaf_hooks, [id](auto& h) { return h.first == id; });
    });
  }
  std::shared_ptr<autograd::Node> node = grad_fn();
  node->pre_hooks().push_back({id, output_nr(), std::move(hook)});
  std::weak_ptr<autograd::Node> weak = node;
  return HookHandle([weak, id] {
    if (auto node = weak.lock())
      std::erase_if(node->pre_hooks(), [id](auto& h) { return h.id == id; });
  });
}

HookHandle Tensor::register_post_accumulate_grad_hook(PostAccumulateGradHook hook) const {
  WEAVE_CHECK(is_leaf() && requires_grad(), "register_post_accumulate_grad_hook",
              "expected a leaf that requires grad, found {}",
              is_leaf() ? "a leaf without requires_grad" : "a non-leaf");
  const uint64_t id = autograd::next_hook_id();
  impl()->meta().post_accumulate_hooks.emplace_back(id, std::move(hook));
  std::weak_ptr<TensorImpl> weak = impl_ptr();
  return HookHandle([weak, id] {
    if (auto impl = weak.lock())
      std::erase_if(impl->meta().post_accumulate_hooks, [id](auto& h) { return h.first == id; });
  });
}

void Tensor::retain_grad() const {
  WEAVE_CHECK(requires_grad(), "retain_grad", "the tensor (shape {}) does not require grad",
              shape());
  if (is_leaf()) return;  // leaves keep their gradient anyway
  AutogradMeta& meta = impl()->meta();
  if (meta.retains_grad) return;
  meta.retains_grad = true;
  std::weak_ptr<TensorImpl> weak = impl_ptr();
  register_hook([weak](const Tensor& grad) {
    if (auto impl = weak.lock()) {
      Tensor& stored = impl->meta().grad;
      // A fresh tensor each time: the incoming gradient may be shared with other consumers.
      Tensor sum = empty(grad.shape(), {.dtype = grad.dtype(), .device = grad.device()});
      if (stored.defined())
        kernels::binary(kernels::BinaryOp::Add, stored, grad, sum);
      else
        kernels::copy(grad, sum);
      stored = sum;
    }
    return Tensor();
  });
}

}  // namespace weave

#include "weave/ops/side_loss.h"

#include <atomic>
#include <cmath>

#include "weave/autograd/function.h"

namespace weave {

namespace {

thread_local SideLossScope* open_scope = nullptr;
// Global, not per thread: backward may run on another thread than the one that scaled the loss.
std::atomic<double> gradient_factor{1.0};

// y -> y; backward: y's gradient through, the loss's gradient the scale held at forward.
struct AttachLoss : autograd::Function<AttachLoss> {
  static constexpr const char* name = "AttachLossBackward";
  static Tensor forward(autograd::FunctionContext& ctx, const Tensor& y, const Tensor& loss,
                        double scale) {
    ctx.data["scale"] = scale;
    ctx.data["loss_shape"] = loss.shape();
    ctx.data["loss_dtype"] = loss.dtype();
    ctx.data["loss_device"] = loss.device();
    return y;
  }
  static std::vector<Tensor> backward(autograd::FunctionContext& ctx,
                                      const std::vector<Tensor>& grads) {
    const double scale = std::any_cast<double>(ctx.data.at("scale")) * gradient_factor.load();
    Tensor dloss = full(std::any_cast<Shape>(ctx.data.at("loss_shape")), scale,
                        {.dtype = std::any_cast<DType>(ctx.data.at("loss_dtype")),
                         .device = std::any_cast<Device>(ctx.data.at("loss_device"))});
    return {grads[0], dloss};
  }
};

}  // namespace

SideLossScope::SideLossScope(double scale) : scale_(scale), outer_(open_scope) {
  open_scope = this;
}

SideLossScope::~SideLossScope() {
  open_scope = outer_;
}

Tensor SideLossScope::total() const {
  return total_.defined() ? total_.to(kCPU).reshape({1}) : zeros({1}, {.dtype = kFloat64});
}

Tensor attach_loss(const Tensor& y, const Tensor& loss) {
  WEAVE_CHECK(y.defined() && loss.defined() && loss.numel() == 1 && is_floating(loss.dtype()),
              "attach_loss", "expected an activation and a floating scalar loss, found {} and {}",
              y.defined() ? y.shape().str() : "undefined",
              loss.defined() ? fmt::format("{} {}", loss.dtype(), loss.shape()) : "undefined");
  const double scale = open_scope ? open_scope->scale_ : 1.0;
  if (open_scope) {
    NoGradGuard no_grad;
    const Tensor scaled = loss.detach().to(kFloat64).reshape({}) * scale;
    open_scope->total_ = open_scope->total_.defined() ? open_scope->total_ + scaled : scaled;
  }
  return AttachLoss::apply(y, loss, scale);
}

void set_attached_loss_gradient_factor(double factor) {
  WEAVE_CHECK(std::isfinite(factor) && factor > 0, "set_attached_loss_gradient_factor",
              "expected a finite factor > 0, found {}", factor);
  gradient_factor.store(factor);
}

double attached_loss_gradient_factor() {
  return gradient_factor.load();
}

}  // namespace weave

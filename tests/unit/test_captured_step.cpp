// Captured training steps. Suite captured_step (CPU): a capturable Adam/AdamW and clipping
// with the norm kept on the device give the host-driven step's bits, and CapturedStep runs
// each call eagerly with its input checks. Suite cuda_graph (a GPU: `weave_cuda_tests
// --test-suite=cuda_graph --require-cuda`): a step captured as a CUDA graph and replayed gives
// the eager steps' losses, norms and parameters bit for bit, and what a capture cannot do raises.
#include <functional>

#include "helpers.h"

using namespace weave;

namespace {

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.defined() && b.defined() && a.shape() == b.shape() && a.dtype() == b.dtype() &&
         equal(a.cpu(), b.cpu());
}

struct TrainerOptions {
  Device device = kCPU;
  bool capturable = true;      // AdamW's numbers on the device
  bool clip_on_device = true;  // clip_grad_norm_on_device_ (else clip_grad_norm_)
  bool autocast = false;       // bfloat16 autocast
  int64_t dim = 32, heads = 2, kv_heads = 1;
};

/// A two-block Llama and its AdamW, one training step a call: inputs are token windows
/// [B, T + 1] and optionally document ids [B, T]; outputs {loss, norm}.
struct Trainer {
  std::shared_ptr<models::Llama> model;
  std::unique_ptr<optim::AdamW> opt;
  TrainerOptions options;

  explicit Trainer(TrainerOptions o) : options(o) {
    Generator init(5);
    model = std::make_shared<models::Llama>(models::LlamaOptions{
        .vocab = 37,
        .dim = o.dim,
        .layers = 2,
        .block = {.heads = o.heads, .kv_heads = o.kv_heads, .hidden = 2 * o.dim},
        .generator = &init});
    model->to(o.device);
    opt =
        std::make_unique<optim::AdamW>(optim::weight_decay_groups(*model, 0.1),
                                       optim::AdamWOptions{.lr = 3e-3, .capturable = o.capturable});
  }

  std::vector<Tensor> step(const std::vector<Tensor>& inputs) {
    const Tensor& windows = inputs[0];
    const int64_t batch = windows.size(0), length = windows.size(1) - 1;
    Tensor x = windows.narrow(1, 0, length), y = windows.narrow(1, 1, length);
    Tensor loss;
    {
      AutocastGuard autocast(kBFloat16, options.autocast);
      Tensor logits =
          model->forward_inputs(nn::Inputs(x, Tensor(), inputs.size() > 1 ? inputs[1] : Tensor()));
      loss = cross_entropy(logits.reshape({batch * length, -1}), y.reshape({batch * length}));
    }
    opt->zero_grad();
    loss.backward();
    Tensor norm = options.clip_on_device
                      ? optim::clip_grad_norm_on_device_(opt->params(), 0.5)
                      : scalar_tensor(optim::clip_grad_norm_(opt->params(), 0.5),
                                      {.dtype = kFloat64, .device = options.device});
    opt->step();
    return {loss, norm};
  }
};

/// Step i's inputs: windows of random tokens, and (packed) documents that change every step.
std::vector<Tensor> batch_of(int step, Device device, bool packed, int64_t length = 64) {
  Generator g(100 + step);
  std::vector<Tensor> inputs{randint(0, 37, {2, length + 1}, {.dtype = kInt64}, &g).to(device)};
  if (packed) {
    std::vector<int64_t> ids(size_t(2 * length));
    const int64_t cut = 5 + 7 * step % (length - 10);  // the second document starts here
    for (int64_t i = 0; i < 2 * length; ++i) ids[size_t(i)] = i % length < cut ? 0 : 1;
    inputs.push_back(from_vector(ids, {2, length}).to(device));
  }
  return inputs;
}

/// The learning rate of step i (changed between calls, as a schedule does).
double lr_of(int step) {
  return 3e-3 * (1.0 - 0.05 * step);
}

/// Trains `steps` steps with `run` (one step a call); returns every step's {loss, norm} and the
/// parameters after the last one, all on the CPU.
std::vector<Tensor> train(Trainer& trainer, int steps, bool packed,
                          const std::function<std::vector<Tensor>(std::vector<Tensor>)>& run) {
  std::vector<Tensor> record;
  for (int i = 0; i < steps; ++i) {
    trainer.opt->set_lr(lr_of(i));
    for (const Tensor& t : run(batch_of(i, trainer.options.device, packed)))
      record.push_back(t.cpu().clone());
  }
  for (const Tensor& p : trainer.model->parameters()) record.push_back(p.cpu().clone());
  return record;
}

void check_same_bits(const std::vector<Tensor>& got, const std::vector<Tensor>& want) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(bitwise_equal(got[i], want[i]));
  }
}

}  // namespace

TEST_SUITE("captured_step") {
  TEST_CASE("a capturable AdamW and clipping on the device give the host-driven step's bits") {
    for (bool packed : {false, true}) {
      CAPTURE(packed);
      Trainer host({.capturable = false, .clip_on_device = false});
      Trainer device({.capturable = true, .clip_on_device = true});
      const std::vector<Tensor> want =
          train(host, 6, packed, [&](auto in) { return host.step(in); });
      const std::vector<Tensor> got =
          train(device, 6, packed, [&](auto in) { return device.step(in); });
      check_same_bits(got, want);
      // The step count lives on the device: checkpoints read it there and write it back.
      CHECK(device.opt->state_dict().scalars.at("step") == 6);
      CHECK(device.opt->state_dict().scalars.at("lr") == host.opt->state_dict().scalars.at("lr"));
      optim::OptimizerState saved = device.opt->state_dict();
      saved.scalars["step"] = 2;
      device.opt->load_state_dict(saved);
      CHECK(device.opt->state_dict().scalars.at("step") == 2);
    }
  }

  TEST_CASE("clip_grad_norm_on_device_ scales like clip_grad_norm_, strided gradients included") {
    for (double norm_type : {2.0, 1.0, 3.0, double(INFINITY)}) {
      for (double max_norm : {0.1, 1e9}) {
        CAPTURE(norm_type);
        CAPTURE(max_norm);
        std::vector<Tensor> a, b;
        Generator g(3);
        for (Shape shape : {Shape{4, 5}, Shape{7}, Shape{3, 6}}) {
          Tensor value = randn(shape, {}, &g);
          Tensor grad = randn(shape, {}, &g);
          for (std::vector<Tensor>* params : {&a, &b}) {
            Tensor p = value.clone().requires_grad_();
            // the last gradient is a transposed view: scaled in place, not through the fused list
            p.set_grad(shape.size() == 2 && shape[0] == 3 ? grad.clone().t().contiguous().t()
                                                          : grad.clone());
            params->push_back(p);
          }
        }
        const double want = optim::clip_grad_norm_(a, max_norm, norm_type);
        const Tensor got = optim::clip_grad_norm_on_device_(b, max_norm, norm_type);
        CHECK(got.dim() == 0);
        CHECK(got.item<double>() == want);
        for (size_t i = 0; i < a.size(); ++i) CHECK(bitwise_equal(b[i].grad(), a[i].grad()));
      }
    }
    std::vector<Tensor> none{zeros({3}).requires_grad_()};
    CHECK(optim::clip_grad_norm_on_device_(none, 1.0).item<double>() == 0.0);
    CHECK_WEAVE_ERROR(optim::clip_grad_norm_on_device_(none, -1.0), "clip_grad_norm_on_device_",
                      "max_norm");
  }

  TEST_CASE("CapturedStep on the CPU runs every call: the plain loop's bits, and its checks") {
    Trainer plain({});
    Trainer stepped({});
    CapturedStep step([&](const std::vector<Tensor>& in) { return stepped.step(in); },
                      {.warmup_calls = 2});
    const std::vector<Tensor> want = train(plain, 5, true, [&](auto in) { return plain.step(in); });
    const std::vector<Tensor> got = train(stepped, 5, true, [&](auto in) { return step(in); });
    check_same_bits(got, want);
    CHECK_FALSE(step.captured());
    CHECK(step.calls() == 5);
    // Another shape, dtype or count of inputs than the first call's raises, naming it.
    std::vector<Tensor> longer = batch_of(0, kCPU, true, 32);
    CHECK_WEAVE_ERROR(step(longer), "CapturedStep", "input 0 is [2, 33] int64");
    CHECK_WEAVE_ERROR(step({batch_of(0, kCPU, false)}), "CapturedStep", "takes 2 inputs");
    CHECK_WEAVE_ERROR(
        CapturedStep([](const std::vector<Tensor>& in) { return in; }, {.warmup_calls = 0}),
        "CapturedStep", "warmup_calls must be at least 1");
    CHECK_WEAVE_ERROR(CapturedStep(nullptr), "CapturedStep", "expected a step function");
  }
}

TEST_SUITE("cuda_graph") {
  TEST_CASE("a captured step replays the eager steps' losses, norms and parameters bit for bit") {
    struct Case {
      bool packed, autocast;
      int64_t dim, heads, kv_heads;
    };
    // float32 (the CUDA-core attention), then bfloat16 autocast on the tensor-core kernels
    // (head size 64, grouped-query), plain and packed windows.
    for (Case c : {Case{false, false, 32, 2, 1}, Case{true, false, 32, 2, 1},
                   Case{false, true, 128, 2, 1}, Case{true, true, 128, 2, 1}}) {
      CAPTURE(c.packed);
      CAPTURE(c.autocast);
      const TrainerOptions o{.device = Device::cuda(0),
                             .autocast = c.autocast,
                             .dim = c.dim,
                             .heads = c.heads,
                             .kv_heads = c.kv_heads};
      Trainer eager(o), graphed(o);
      CapturedStep step([&](const std::vector<Tensor>& in) { return graphed.step(in); });
      const std::vector<Tensor> want =
          train(eager, 10, c.packed, [&](auto in) { return eager.step(in); });
      const std::vector<Tensor> got =
          train(graphed, 10, c.packed, [&](auto in) { return step(in); });
      CHECK(step.captured());
      check_same_bits(got, want);
      CHECK(graphed.opt->state_dict().scalars.at("step") == 10);
    }
  }

  TEST_CASE("what a capture cannot do raises, and the next capture works") {
    const Device gpu = Device::cuda(0);
    Trainer trainer({.device = gpu});
    auto reads_on_host = [&](const std::vector<Tensor>& in) {
      std::vector<Tensor> out = trainer.step(in);
      (void)out[0].item<double>();
      return out;
    };
    CapturedStep bad(reads_on_host, {.warmup_calls = 1});
    bad(batch_of(0, gpu, false));
    CHECK_WEAVE_ERROR(bad(batch_of(1, gpu, false)), "to", "while a CUDA graph captures");
    // After the failed capture the device is usable, and another step captures.
    CapturedStep good([&](const std::vector<Tensor>& in) { return trainer.step(in); },
                      {.warmup_calls = 1});
    good(batch_of(2, gpu, false));
    std::vector<Tensor> out = good(batch_of(3, gpu, false));
    CHECK(good.captured());
    CHECK(std::isfinite(out[0].item<double>()));
    CHECK_WEAVE_ERROR(good(batch_of(4, gpu, false, 32)), "CapturedStep", "made for [2, 65]");

    Trainer host_counted({.device = gpu, .capturable = false});
    CapturedStep uncapturable([&](const std::vector<Tensor>& in) { return host_counted.step(in); },
                              {.warmup_calls = 1});
    uncapturable(batch_of(0, gpu, false));
    CHECK_WEAVE_ERROR(uncapturable(batch_of(1, gpu, false)), "Adam.step", "capturable = true");

    Tensor x = randn({4, 4}, {.device = gpu});
    CapturedStep dropping(
        [](const std::vector<Tensor>& in) {
          return std::vector<Tensor>{dropout(in[0], 0.5, true)};
        },
        {.warmup_calls = 1});
    dropping({x});
    CHECK_WEAVE_ERROR(dropping({x}), "dropout", "captured");
  }
}

// The op table (tests/op_table.h) on a GPU against the CPU: every case's values and gradients,
// in float64 to 1e-9 and in float32, bfloat16 and float16 to each dtype's rounding, from the
// same rounded inputs on both sides. Run with --require-cuda (skipped without a GPU).
#include <string>

#include "helpers.h"
#include "op_table.h"

using namespace weave;
using namespace weave::test;

namespace {

// "" when gpu (on a GPU) equals cpu within tol (1 + max |cpu|) elementwise, with non-finite
// elements in the same places; else what differs.
std::string mismatch(const Tensor& cpu, const Tensor& gpu, double tol) {
  if (cpu.shape() != gpu.shape()) return fmt::format("shapes {} and {}", cpu.shape(), gpu.shape());
  if (cpu.numel() == 0) return "";
  Tensor a = cpu.detach().to(kFloat64), b = gpu.detach().cpu().to(kFloat64);
  Tensor finite = isfinite(a);
  if (!equal(finite, isfinite(b))) return "non-finite elements in different places";
  Tensor zero = zeros(a.shape(), {.dtype = kFloat64});
  a = where(finite, a, zero);
  b = where(finite, b, zero);
  const double error = max(abs(a - b)).item<double>(), scale = max(abs(a)).item<double>();
  if (error <= tol * (1 + scale)) return "";
  return fmt::format("max |gpu - cpu| = {:.3g} at scale {:.3g} (tolerance {:.3g})", error, scale,
                     tol * (1 + scale));
}

// One case in `dtype` on the CPU and the GPU from the same rounded inputs: values and gradients
// checked. False when the CPU refuses the dtype (and the GPU must refuse it too).
bool compare_on_gpu(const OpCase& c, DType dtype, double tol, Generator& generator) {
  const Device gpu = Device::cuda(0);
  std::vector<Tensor> cpu_inputs, gpu_inputs;
  for (const Tensor& t : make_inputs(c.inputs, generator)) {
    Tensor rounded = t.detach().to(dtype);
    cpu_inputs.push_back(rounded.clone().requires_grad_());
    gpu_inputs.push_back(rounded.to(gpu).requires_grad_());
  }
  Tensor cpu_out, gpu_out;
  const std::string cpu_error = error_of([&] { cpu_out = c.fn(cpu_inputs); });
  const std::string gpu_error = error_of([&] { gpu_out = c.fn(gpu_inputs); });
  if (!cpu_error.empty()) {
    CHECK_MESSAGE(!gpu_error.empty(), "CPU raised: ", cpu_error);
    return false;
  }
  if (!gpu_error.empty()) {
    CHECK_MESSAGE(false, "GPU raised: ", gpu_error);
    return true;
  }
  CHECK(gpu_out.device() == gpu);
  CHECK_MESSAGE(gpu_out.dtype() == cpu_out.dtype(), gpu_out.dtype(), " vs ", cpu_out.dtype());
  const std::string values = mismatch(cpu_out, gpu_out, tol);
  CHECK_MESSAGE(values.empty(), "values: ", values);
  Generator seed(5);
  Tensor probe = randn(cpu_out.shape(), {.dtype = kFloat64}, &seed).to(cpu_out.dtype());
  sum(cpu_out * probe).backward();
  sum(gpu_out * probe.to(gpu)).backward();
  for (size_t i = 0; i < cpu_inputs.size(); ++i) {
    CAPTURE(i);
    Tensor a = cpu_inputs[i].grad(), b = gpu_inputs[i].grad();
    CHECK(a.defined() == b.defined());
    if (a.defined() && b.defined()) {
      const std::string grads = mismatch(a, b, 2 * tol);
      CHECK_MESSAGE(grads.empty(), "gradient: ", grads);
    }
  }
  return true;
}

}  // namespace

TEST_SUITE("cuda") {
  TEST_CASE("every op on CUDA matches CPU in float64, float32, bfloat16 and float16") {
    // Both sides get the same rounded inputs; the tolerance is the dtype's rounding scaled by
    // the result's magnitude (reductions and products round at each step, in different orders).
    struct Precision {
      DType dtype;
      double tol;
    };
    int compared = 0, refused = 0;
    for (Precision p : {Precision{kFloat64, 1e-9}, Precision{kFloat32, 1e-4},
                        Precision{kBFloat16, 3e-2}, Precision{kFloat16, 5e-3}}) {
      int index = 0;
      for (const OpCase& c : op_cases()) {
        CAPTURE(p.dtype);
        CAPTURE(c.op);
        CAPTURE(index);
        Generator generator(1000 + index++);
        try {  // one case's error is reported, and the others still run
          const bool ran = compare_on_gpu(c, p.dtype, p.tol, generator);
          CHECK_MESSAGE((ran || p.dtype != kFloat64), "every op takes float64");
          (ran ? compared : refused) += 1;
        } catch (const std::exception& e) {
          CHECK_MESSAGE(false, "raised: ", e.what());
        }
      }
    }
    fmt::print("cuda table compared {} cases with CPU ({} refused alike)\n", compared, refused);
    CHECK(compared > 0);
  }
}

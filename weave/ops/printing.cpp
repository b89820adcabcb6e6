// Printing tensors and comparing whole tensors.
#include <ostream>
#include <string>
#include <vector>

#include "weave/autograd/grad_mode.h"
#include "weave/ops/internal.h"

namespace weave {

// ---- printing ---------------------------------------------------------------------------

namespace {

constexpr int64_t kSummarizeAbove = 1000;
constexpr int64_t kEdgeItems = 3;

void print_values(std::string& out, const std::vector<double>& values, const Shape& shape, int dim,
                  int64_t offset, bool summarize,
                  const std::string& (*format)(double, std::string&), std::string& scratch) {
  if (shape.size() == 0) {
    out += format(values[0], scratch);
    return;
  }
  const int64_t size = shape[dim];
  int64_t stride = 1;
  for (int d = dim + 1; d < shape.size(); ++d) stride *= shape[d];
  out += '[';
  for (int64_t i = 0; i < size; ++i) {
    if (summarize && size > 2 * kEdgeItems && i == kEdgeItems) {
      out += "..., ";
      i = size - kEdgeItems - 1;
      continue;
    }
    if (dim == shape.size() - 1) {
      out += format(values[offset + i], scratch);
    } else {
      print_values(out, values, shape, dim + 1, offset + i * stride, summarize, format, scratch);
    }
    if (i + 1 < size) out += dim == shape.size() - 1 ? ", " : ",\n" + std::string(8 + dim, ' ');
  }
  out += ']';
}

const std::string& format_float(double v, std::string& s) {
  double a = std::fabs(v);
  s = (a != 0 && (a >= 1e6 || a < 1e-4)) ? fmt::format("{:.4e}", v) : fmt::format("{:.4f}", v);
  return s;
}
const std::string& format_int(double v, std::string& s) {
  s = fmt::format("{}", static_cast<int64_t>(v));
  return s;
}
const std::string& format_bool(double v, std::string& s) {
  s = v != 0 ? "true" : "false";
  return s;
}

}  // namespace

std::string Tensor::str() const {
  if (!defined()) return "tensor(undefined)";
  std::string body;
  if (numel() == 0) {
    body = "[]";
  } else {
    std::vector<double> values = to_vector<double>();
    auto format = is_floating(dtype()) ? format_float : dtype() == kBool ? format_bool : format_int;
    std::string scratch;
    print_values(body, values, shape(), 0, 0, numel() > kSummarizeAbove, format, scratch);
  }
  std::string text =
      fmt::format("tensor({}, shape={}, dtype={}, device={}", body, shape(), dtype(), device());
  if (grad_fn())
    text += fmt::format(", grad_fn={}", grad_fn()->name());
  else if (requires_grad())
    text += ", requires_grad=true";
  return text + ")";
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) {
  return os << t.str();
}

// ---- whole-tensor comparison ------------------------------------------------------------

bool allclose(const Tensor& a, const Tensor& b, double rtol, double atol) {
  NoGradGuard no_grad;
  Tensor a64 = a.to(kFloat64), b64 = b.to(kFloat64);
  Tensor ok = le(abs(a64 - b64), abs(b64) * rtol + atol);
  return sum(ok).item<int64_t>() == ok.numel();
}

bool equal(const Tensor& a, const Tensor& b) {
  NoGradGuard no_grad;
  if (a.shape() != b.shape()) return false;
  return sum(eq(a, b)).item<int64_t>() == a.numel();
}

}  // namespace weave

#include "weave/nn/summary.h"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

namespace weave::nn {

namespace {

// 1234567 -> "1,234,567".
std::string grouped(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

// 74368 -> "74.4 K", with the unit's step (1000 for counts, 1024 for bytes).
std::string scaled(double n, double step, const char* const (&units)[5]) {
  int u = 0;
  while (n >= step && u < 4) n /= step, ++u;
  return u == 0 ? fmt::format("{:.0f}{}", n, units[0]) : fmt::format("{:.1f}{}", n, units[u]);
}

struct Row {
  std::string label, type;
  int64_t count;
};

void collect(const Module& module, const std::string& indent, int depth, std::vector<Row>& rows) {
  if (depth <= 0) return;
  const auto children = module.named_children();
  for (size_t i = 0; i < children.size(); ++i) {
    const bool last = i + 1 == children.size();
    const auto& [name, child] = children[i];
    rows.push_back(
        {indent + (last ? "└─ " : "├─ ") + name, child->name(), count_parameters(*child).total});
    collect(*child, indent + (last ? "   " : "│  "), depth - 1, rows);
  }
}

// Display width of a label: its box-drawing characters take 3 bytes and one column.
size_t width(const std::string& s) {
  size_t columns = 0;
  for (const unsigned char c : s) columns += (c & 0xC0) != 0x80;
  return columns;
}

}  // namespace

ParameterCount count_parameters(const Module& model) {
  ParameterCount count;
  for (const Tensor& p : model.parameters()) {
    if (!p.defined()) continue;
    count.total += p.numel();
    if (p.requires_grad()) count.trainable += p.numel();
    count.bytes += p.numel() * int64_t(p.itemsize());
  }
  return count;
}

std::string summary(const Module& model, int depth) {
  std::vector<Row> rows;
  collect(model, "", depth, rows);
  size_t label = width(model.name()), type = 0;
  for (const Row& r : rows)
    label = std::max(label, width(r.label)), type = std::max(type, r.type.size());
  std::string out = fmt::format("{}{}  parameters\n", model.name(),
                                std::string(label - width(model.name()) + type + 2, ' '));
  for (const Row& r : rows)
    out += fmt::format("{}{}  {:<{}}  {:>10}\n", r.label, std::string(label - width(r.label), ' '),
                       r.type, type, grouped(r.count));
  static const char* const kCounts[5] = {"", " K", " M", " B", " T"};
  static const char* const kBytes[5] = {" B", " KB", " MB", " GB", " TB"};
  const ParameterCount total = count_parameters(model);
  out += fmt::format("total {} parameters ({}), {} trainable, {} frozen, {}\n",
                     grouped(total.total), scaled(double(total.total), 1000, kCounts),
                     grouped(total.trainable), grouped(total.total - total.trainable),
                     scaled(double(total.bytes), 1024, kBytes));
  return out;
}

}  // namespace weave::nn

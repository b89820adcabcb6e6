// CPU kernels: copies, fills, reductions (Eigen where it vectorizes) and index gathers. The
// elementwise families are elementwise_*.cpp, GEMM is gemm.cpp.
#include <algorithm>
#include <cstring>

#include "weave/kernels/backends.h"
#include "weave/kernels/common/elementwise.h"
#include "weave/kernels/cpu/eigen.h"
#include "weave/kernels/cpu/loops.h"

namespace weave::kernels::cpu {

namespace {

template <class T>
constexpr bool kEigenScalar = std::is_same_v<T, float> || std::is_same_v<T, double> ||
                              std::is_same_v<T, int32_t> || std::is_same_v<T, int64_t>;

// fn(T{}) for float32 and float64: the kernels the front end computes reduced precision in float32.
template <class Fn>
void float_or_double(DType dtype, const char* op, const Fn& fn) {
  if (dtype == kFloat32) return fn(float{});
  if (dtype == kFloat64) return fn(double{});
  WEAVE_FAIL(op, "expected float32 or float64, found {}", dtype);
}

}  // namespace

void copy(const Tensor& src, const Tensor& dst) {
  if (src.dtype() == dst.dtype() && src.is_contiguous() && dst.is_contiguous() &&
      src.shape() == dst.shape()) {
    if (src.data_ptr() != dst.data_ptr())
      std::memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.itemsize());
    return;
  }
  visit_dtype(dst.dtype(), [&](auto out_tag) {
    using TO = typename decltype(out_tag)::type;
    visit_dtype(src.dtype(), [&](auto in_tag) {
      using TI = typename decltype(in_tag)::type;
      map<TO, TI>([](auto v) { return v; }, dst, src);
    });
  });
}

void fill(const Tensor& dst, double value) {
  visit_dtype(dst.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T v = T(static_cast<compute_t<T>>(value));
    if (dst.is_contiguous()) {
      std::fill_n(static_cast<T*>(dst.data_ptr()), dst.numel(), v);
    } else {
      map<T>([v]() { return compute_t<T>(v); }, dst);
    }
  });
}

namespace {

// Sums over the middle of [outer, reduced, inner] with inner > 1 (a bias gradient: [batch,
// features] summed over the batch). Rows are added whole into a block of accumulators, which
// vectorizes across the contiguous inner dim; Eigen's colwise sum of a row-major map walks
// each column with a stride. Blocks of kBlockRows rows are summed first and then added to
// the total, which keeps float32's rounding error growing with the number of blocks, not rows.
template <class T>
void sum_over_rows(const T* x, int64_t outer, int64_t reduced, int64_t inner, T* o) {
  using C = compute_t<T>;
  constexpr int64_t kBlockCols = 512, kBlockRows = 64;
  const int64_t col_blocks = (inner + kBlockCols - 1) / kBlockCols;
  const int64_t tasks = outer * col_blocks;
#pragma omp parallel for num_threads(threads_for(outer* reduced* inner)) if (tasks > 1)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t b = task / col_blocks, j0 = (task % col_blocks) * kBlockCols;
    const int64_t cols = std::min(kBlockCols, inner - j0);
    C total[kBlockCols], part[kBlockCols];
    std::fill_n(total, cols, C(0));
    const T* base = x + b * reduced * inner + j0;
    for (int64_t k0 = 0; k0 < reduced; k0 += kBlockRows) {
      std::fill_n(part, cols, C(0));
      const int64_t k1 = std::min(reduced, k0 + kBlockRows);
      for (int64_t k = k0; k < k1; ++k) {
        const T* row = base + k * inner;
        for (int64_t j = 0; j < cols; ++j) part[j] += C(row[j]);
      }
      for (int64_t j = 0; j < cols; ++j) total[j] += part[j];
    }
    for (int64_t j = 0; j < cols; ++j) o[b * inner + j0 + j] = T(total[j]);
  }
}

// Sums over the last dim ([outer, reduced]): contiguous rows, Eigen vectorizes each.
template <class T>
void sum_eigen(const T* x, int64_t outer, int64_t reduced, T* o) {
  using Map = Eigen::Map<const RowMajor<T>>;
  using Out = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, 1>>;
  Out(o, outer) = Map(x, outer, reduced).rowwise().sum();
}

template <class T>
void reduce_typed(ReduceOp op, const T* x, int64_t outer, int64_t reduced, int64_t inner,
                  const Tensor& out) {
  using C = compute_t<T>;
  if (op == ReduceOp::ArgMax || op == ReduceOp::ArgMin) {
    int64_t* o = static_cast<int64_t*>(out.data_ptr());
    const bool is_max = op == ReduceOp::ArgMax;
    for (int64_t b = 0; b < outer; ++b)
      for (int64_t j = 0; j < inner; ++j) {
        const T* p = x + b * reduced * inner + j;
        int64_t best = 0;
        C best_value = C(p[0]);
        for (int64_t k = 1; k < reduced; ++k) {
          C v = C(p[k * inner]);
          if (best_value != best_value) break;  // NaN wins, first one
          if (v != v || (is_max ? v > best_value : v < best_value)) {
            best = k;
            best_value = v;
          }
        }
        o[b * inner + j] = best;
      }
    return;
  }
  T* o = static_cast<T*>(out.data_ptr());
  if (op == ReduceOp::Sum && inner > 1) return sum_over_rows(x, outer, reduced, inner, o);
  if constexpr (kEigenScalar<T>) {
    if (op == ReduceOp::Sum) return sum_eigen(x, outer, reduced, o);
  }
  // Max/min propagate NaN, which Eigen's vectorwise max/min do not promise.
  for (int64_t b = 0; b < outer; ++b)
    for (int64_t j = 0; j < inner; ++j) {
      const T* p = x + b * reduced * inner + j;
      C acc = op == ReduceOp::Sum ? C(0) : C(p[0]);
      for (int64_t k = 0; k < reduced; ++k) {
        C v = C(p[k * inner]);
        if (op == ReduceOp::Sum) acc = acc + v;
        if (op == ReduceOp::Max) acc = (v != v || v > acc) ? v : acc;
        if (op == ReduceOp::Min) acc = (v != v || v < acc) ? v : acc;
      }
      o[b * inner + j] = T(acc);
    }
}

}  // namespace

void reduce(ReduceOp op, const Tensor& x, int64_t outer, int64_t reduced, int64_t inner,
            const Tensor& out) {
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, bool>) {
      WEAVE_FAIL("reduce", "bool tensors are reduced as integers; hint: .to(kInt64)");
    } else {
      reduce_typed<T>(op, static_cast<const T*>(x.data_ptr()), outer, reduced, inner, out);
    }
  });
}

void index_select(const Tensor& src, int64_t outer, int64_t n, int64_t inner, const Tensor& index,
                  const Tensor& out) {
  const int64_t* idx = index.data<int64_t>();
  const int64_t count = index.numel();
  const size_t row_bytes = inner * src.itemsize();
  const char* s = static_cast<const char*>(src.data_ptr());
  char* o = static_cast<char*>(out.data_ptr());
  for (int64_t b = 0; b < outer; ++b)
    for (int64_t i = 0; i < count; ++i)
      std::memcpy(o + (b * count + i) * row_bytes, s + (b * n + idx[i]) * row_bytes, row_bytes);
}

void index_add(const Tensor& dst, int64_t outer, int64_t n, int64_t inner, const Tensor& index,
               const Tensor& src) {
  const int64_t* idx = index.data<int64_t>();
  const int64_t count = index.numel();
  visit_arithmetic(dst.dtype(), "index_add", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* d = static_cast<T*>(dst.data_ptr());
    const T* s = static_cast<const T*>(src.data_ptr());
    for (int64_t b = 0; b < outer; ++b)
      for (int64_t i = 0; i < count; ++i) {
        T* row = d + (b * n + idx[i]) * inner;
        const T* from = s + (b * count + i) * inner;
        for (int64_t j = 0; j < inner; ++j)
          row[j] = T(compute_t<T>(row[j]) + compute_t<T>(from[j]));
      }
  });
}

void gather_weighted_sum(const Tensor& rows, const Tensor& index, const Tensor& weight,
                         const Tensor& out) {
  const int64_t tokens = out.size(0), h = out.size(1), k = index.size(1);
  const int64_t* idx = index.data<int64_t>();
  float_or_double(out.dtype(), "gather_weighted_sum", [&](auto zero) {
    using T = decltype(zero);
    const T *r = rows.data<T>(), *w = weight.data<T>();
    T* o = out.data<T>();
    const int threads = threads_for(tokens * k * h);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      T* row = o + t * h;
      std::fill(row, row + h, T(0));
      for (int64_t j = 0; j < k; ++j) {
        const int64_t from = idx[t * k + j];
        if (from < 0) continue;
        const T scale = w[t * k + j];
        const T* source = r + from * h;
        for (int64_t c = 0; c < h; ++c) row[c] += scale * source[c];
      }
    }
  });
}

void gather_weighted_sum_backward(const Tensor& grad, const Tensor& rows, const Tensor& index,
                                  const Tensor& weight, const Tensor& d_rows,
                                  const Tensor& d_weight) {
  const int64_t tokens = grad.size(0), h = grad.size(1), k = index.size(1);
  const int64_t* idx = index.data<int64_t>();
  float_or_double(grad.dtype(), "gather_weighted_sum", [&](auto zero) {
    using T = decltype(zero);
    const T *g = grad.data<T>(), *r = rows.data<T>(), *w = weight.data<T>();
    T *dr = d_rows.data<T>(), *dw = d_weight.data<T>();
    std::fill(dr, dr + d_rows.numel(), T(0));
    // Tokens in order (two may pick one row), each token's row of grad read once for both.
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t j = 0; j < k; ++j) {
        const int64_t from = idx[t * k + j];
        if (from < 0) {
          dw[t * k + j] = T(0);
          continue;
        }
        const T scale = w[t * k + j];
        const T *gt = g + t * h, *source = r + from * h;
        T* target = dr + from * h;
        T dot = 0;
        for (int64_t c = 0; c < h; ++c) {
          dot += gt[c] * source[c];
          target[c] += scale * gt[c];
        }
        dw[t * k + j] = dot;
      }
  });
}

}  // namespace weave::kernels::cpu

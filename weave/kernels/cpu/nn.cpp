// CPU kernels of the fused neural-network ops: softmax, layer/RMS norm and cross-entropy row
// by row (each row in cache across its passes), bias + activation through the strided loop.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "weave/kernels/backends.h"
#include "weave/kernels/cpu/loops.h"
#include "weave/kernels/cpu/vector_math.h"

namespace weave::kernels::cpu {

namespace {

/// Calls row(i) for every row, in parallel when rows * n is large enough.
template <class Row>
void for_rows(int64_t rows, int64_t n, const Row& row) {
  const int threads = threads_for(rows * n);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t i = 0; i < rows; ++i) row(i);
}

int64_t rows_of(const Tensor& t, int64_t n) {
  return n == 0 ? 0 : t.numel() / n;
}

}  // namespace

void softmax(const Tensor& x, const Tensor& out, bool log) {
  const int64_t n = x.dim() == 0 ? 1 : x.size(-1);
  visit_floating(x.dtype(), log ? "log_softmax" : "softmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* px = x.data<T>();
    T* po = out.data<T>();
    for_rows(rows_of(x, n), n, [&](int64_t i) {
      const T* xi = px + i * n;
      T* oi = po + i * n;
      const T shift = safe_shift(row_max(xi, n));
      if (log) {
        const T sum = row_sum<T>(n, [&](int64_t j) { return std::exp(xi[j] - shift); });
        const T offset = shift + std::log(sum);
        for (int64_t j = 0; j < n; ++j) oi[j] = xi[j] - offset;
      } else {
        std::copy_n(xi, n, oi);
        const T inverse = T(1) / exp_shifted_in_place(oi, n, shift);
        for (int64_t j = 0; j < n; ++j) oi[j] *= inverse;
      }
    });
  });
}

void softmax_backward(const Tensor& grad, const Tensor& y, const Tensor& out, bool log) {
  const int64_t n = y.dim() == 0 ? 1 : y.size(-1);
  visit_floating(y.dtype(), log ? "log_softmax" : "softmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T *pg = grad.data<T>(), *py = y.data<T>();
    T* po = out.data<T>();
    for_rows(rows_of(y, n), n, [&](int64_t i) {
      const T *gi = pg + i * n, *yi = py + i * n;
      T* oi = po + i * n;
      if (log) {
        const T total = row_sum<T>(n, [&](int64_t j) { return gi[j]; });
        for (int64_t j = 0; j < n; ++j) oi[j] = gi[j] - std::exp(yi[j]) * total;
      } else {
        const T total = row_sum<T>(n, [&](int64_t j) { return gi[j] * yi[j]; });
        for (int64_t j = 0; j < n; ++j) oi[j] = yi[j] * (gi[j] - total);
      }
    });
  });
}

void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, bool rms,
                const Tensor& out, const Tensor& mean, const Tensor& rstd) {
  const int64_t n = x.size(-1);
  visit_floating(x.dtype(), rms ? "rms_norm" : "layer_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* px = x.data<T>();
    const T* w = weight.defined() ? weight.data<T>() : nullptr;
    const T* b = bias.defined() ? bias.data<T>() : nullptr;
    T *po = out.data<T>(), *pm = rms ? nullptr : mean.data<T>(), *pr = rstd.data<T>();
    for_rows(rows_of(x, n), n, [&](int64_t i) {
      const T* xi = px + i * n;
      T* oi = po + i * n;
      const T mu = rms ? T(0) : row_sum<T>(n, [&](int64_t j) { return xi[j]; }) / T(n);
      const T squares = row_sum<T>(n, [&](int64_t j) { return (xi[j] - mu) * (xi[j] - mu); });
      const T r = T(1) / std::sqrt(squares / T(n) + T(eps));
      if (pm) pm[i] = mu;
      pr[i] = r;
      for (int64_t j = 0; j < n; ++j) {
        T v = (xi[j] - mu) * r;
        if (w) v *= w[j];
        if (b) v += b[j];
        oi[j] = v;
      }
    });
  });
}

void layer_norm_backward(const Tensor& grad, const Tensor& x, const Tensor& weight,
                         const Tensor& mean, const Tensor& rstd, bool rms, const Tensor& dx,
                         const Tensor& dweight, const Tensor& dbias) {
  const int64_t n = x.size(-1), rows = rows_of(x, n);
  visit_floating(x.dtype(), rms ? "rms_norm" : "layer_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T *pg = grad.data<T>(), *px = x.data<T>(), *pr = rstd.data<T>();
    const T* pm = rms ? nullptr : mean.data<T>();
    const T* w = weight.defined() ? weight.data<T>() : nullptr;
    T* pdx = dx.defined() ? dx.data<T>() : nullptr;
    const bool want_dw = dweight.defined(), want_db = dbias.defined();
    const int threads = threads_for(rows * n);
    // Each thread sums its rows' dweight/dbias into its own buffer; the buffers are added last
    // (in a fixed order, so the result does not depend on scheduling).
    std::vector<T> partial(size_t(threads) * 2 * n, T(0));
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
      const int t = omp_get_thread_num();
      T* pdw = partial.data() + size_t(t) * 2 * n;
      T* pdb = pdw + n;
#pragma omp for schedule(static)
      for (int64_t i = 0; i < rows; ++i) {
        const T *gi = pg + i * n, *xi = px + i * n;
        const T mu = pm ? pm[i] : T(0), r = pr[i];
        // sums of (g w) and (g w) xhat
        auto gw = [&](int64_t j) { return w ? gi[j] * w[j] : gi[j]; };
        const T sum_g = row_sum<T>(n, gw);
        const T sum_gx = row_sum<T>(n, [&](int64_t j) { return gw(j) * (xi[j] - mu) * r; });
        if (want_dw)
          for (int64_t j = 0; j < n; ++j) pdw[j] += gi[j] * (xi[j] - mu) * r;
        if (want_db)
          for (int64_t j = 0; j < n; ++j) pdb[j] += gi[j];
        if (pdx) {
          T* di = pdx + i * n;
          const T mean_g = rms ? T(0) : sum_g / T(n), mean_gx = sum_gx / T(n);
          for (int64_t j = 0; j < n; ++j) di[j] = r * (gw(j) - mean_g - (xi[j] - mu) * r * mean_gx);
        }
      }
    }
    for (auto [wanted, target, offset] :
         {std::tuple{want_dw, dweight, int64_t(0)}, std::tuple{want_db, dbias, n}}) {
      if (!wanted) continue;
      T* d = target.template data<T>();
      std::fill_n(d, n, T(0));
      for (int t = 0; t < threads; ++t)
        for (int64_t j = 0; j < n; ++j) d[j] += partial[size_t(t) * 2 * n + offset + j];
    }
  });
}

void cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                   const Tensor& loss, const Tensor& lse) {
  const int64_t n = logits.size(-1);
  visit_floating(logits.dtype(), "cross_entropy", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* px = logits.data<T>();
    const int64_t* pt = target.data<int64_t>();
    T *pl = loss.data<T>(), *pe = lse.data<T>();
    for_rows(rows_of(logits, n), n, [&](int64_t i) {
      const T* xi = px + i * n;
      const T shift = safe_shift(row_max(xi, n));
      const T sum = row_sum<T>(n, [&](int64_t j) { return std::exp(xi[j] - shift); });
      pe[i] = shift + std::log(sum);
      pl[i] = pt[i] == ignore_index ? T(0) : pe[i] - xi[pt[i]];
    });
  });
}

void cross_entropy_backward(const Tensor& grad, const Tensor& logits, const Tensor& target,
                            int64_t ignore_index, const Tensor& lse, const Tensor& dlogits) {
  const int64_t n = logits.size(-1);
  visit_floating(logits.dtype(), "cross_entropy", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T *px = logits.data<T>(), *pg = grad.data<T>(), *pe = lse.data<T>();
    const int64_t* pt = target.data<int64_t>();
    T* pd = dlogits.data<T>();
    const int64_t grad_stride = grad.numel() == 1 ? 0 : 1;  // a mean's gradient is one number
    for_rows(rows_of(logits, n), n, [&](int64_t i) {
      const T *xi = px + i * n, g = pg[i * grad_stride], e = pe[i];
      T* di = pd + i * n;
      if (pt[i] == ignore_index) {
        std::fill_n(di, n, T(0));
        return;
      }
      for (int64_t j = 0; j < n; ++j) di[j] = g * std::exp(xi[j] - e);
      di[pt[i]] -= g;
    });
  });
}

}  // namespace weave::kernels::cpu
